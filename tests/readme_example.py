"""The README's "Write your own algorithm" code, extracted and run as it is written there."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_code(definition_only: bool = False) -> str:
    """The first ```python block after the heading "## Write your own algorithm".

    ``definition_only``: the block up to its usage lines (the first line starting ``data =``).
    """
    text = README.read_text()
    section = text[text.index("## Write your own algorithm"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return code[:code.index("\ndata = ")] if definition_only else code


def run_readme_code(definition_only: bool = False) -> dict:
    """Executes the block; returns its namespace (``fedavg_momentum``, and ``fed``, ``algo``, ``result``)."""
    namespace: dict = {}
    exec(compile(readme_code(definition_only), str(README), "exec"), namespace)
    return namespace
