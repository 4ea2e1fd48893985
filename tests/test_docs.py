"""The documentation's code runs as written, and every command-line flag it names exists.

Each page's ``.. code-block:: python`` blocks run in order in one namespace, as a reader would run
them; the assertions check what the surrounding text says about the output.
"""
import pathlib
import re
import textwrap

import jax
import numpy as np
from absl import flags

from experiments import algorithm_flags

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
EXPERIMENTS = DOCS.parent / "experiments"
PAGES = sorted(DOCS.glob("*.rst")) + sorted((DOCS / "methods").glob("*.rst"))


def python_blocks(page: pathlib.Path) -> list[str]:
    """The page's ``.. code-block:: python`` blocks, dedented, in page order."""
    pattern = r"^\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)"
    return [textwrap.dedent(m.group(1)) for m in re.finditer(pattern, page.read_text(), re.M)]


def run_page(name: str) -> dict:
    """Executes every Python block of ``docs/<name>`` in one namespace; returns the namespace."""
    page = DOCS / name
    blocks = python_blocks(page)
    assert blocks, f"{name} has no python code blocks"
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    return namespace


def test_getting_started_runs_and_fola_leads_on_the_skewed_split():
    ns = run_page("getting_started.rst")
    fedavg, fola = ns["results"]["fedavg"].metrics, ns["results"]["fola"].metrics
    assert len(fedavg["global_accuracy"]) == len(fola["global_accuracy"]) == 3
    assert min(fedavg["global_accuracy"][-1], fola["global_accuracy"][-1]) > 0.4  # both learn (chance: 0.1)
    assert fola["global_accuracy"][0] > fedavg["global_accuracy"][0]  # the page's claim: the product helps in round 1
    assert {"precision_below_eps", "precision_median", "local_accuracy"} <= set(fola)
    assert ns["same_fola"].name == "fola" and ns["same_fola"].hparams == {"lr": 0.05, "lam": 100.0}


def test_custom_algorithm_page_runs_streams_and_keeps_persistent_state():
    ns = run_page("custom_algorithm.rst")
    result, streamed, fed = ns["result"], ns["result_streamed"], ns["fed"]
    assert result.metrics["real_clients"] == [5.0, 5.0]  # clients_per_round=5: padding never counts
    assert all(d > 0 for d in result.metrics["drift"])
    # the streamed, chunked aggregation is the same algorithm
    np.testing.assert_allclose(streamed.metrics["global_accuracy"], result.metrics["global_accuracy"], atol=1e-6)
    for a, b in zip(jax.tree.leaves(streamed.state.server), jax.tree.leaves(result.state.server)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    # persistent state: sampled clients moved their buffer, the others still hold zeros
    buffers = ns["buffers"]
    assert all(leaf.shape[0] == fed.num_clients for leaf in jax.tree.leaves(buffers))
    assert 5 <= int(ns["moved"].sum()) <= fed.num_clients


def test_robust_page_builds_its_wrappers():
    ns = run_page("methods/robust.rst")
    assert ns["median_fedavg"].name == "fedavg+median"
    assert ns["robust_fola"].name == "fola+robust_product"


def test_every_flag_the_docs_name_exists():
    flag_values = flags.FlagValues()
    algorithm_flags.define(flag_values)
    defined = set(flag_values) | {"flagfile", "helpshort"}
    defined |= set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', (EXPERIMENTS / "run.py").read_text()))
    defined |= set(re.findall(r'add_argument\(\s*"--(\w+)"', (EXPERIMENTS / "compare.py").read_text()))
    booleans = {name for name in flag_values if isinstance(flag_values[name], flags.BooleanFlag)}
    booleans |= set(re.findall(r'flags\.DEFINE_bool(?:ean)?\(\s*"(\w+)"', (EXPERIMENTS / "run.py").read_text()))
    named = {(page.name, flag) for page in PAGES for flag in re.findall(r"--([a-z][a-z0-9_]*)", page.read_text())}
    unknown = sorted((page, flag) for page, flag in named
                     if flag not in defined and not (flag.startswith("no") and flag[2:] in booleans))
    assert not unknown, f"docs name flags that neither experiments.run nor experiments.compare defines: {unknown}"
    assert len(named) > 50  # the method pages list the flags
