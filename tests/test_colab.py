"""Every notebook in colab/ runs top to bottom offline (shell lines such as `!pip` are skipped)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("!", "%")))
    namespace = {}
    exec(compile(code, str(path), "exec"), namespace)
    results = namespace["results"]  # every notebook ends with its runs' SimulationResults by name
    assert results, path.name
    for name, result in results.items():
        rounds = result.metrics["round"]
        assert rounds == list(range(1, len(rounds) + 1)), name
        assert max(result.metrics["global_accuracy"]) > 0.3, name  # learned: digits chance is 0.1
