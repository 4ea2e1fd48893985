"""The Bazel BUILD file lists every library module and every test."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _listed():
    return set(re.findall(r'"([\w/]+\.py)"', (ROOT / "BUILD").read_text()))


def test_build_lists_every_module_and_test():
    listed = _listed()
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "bfedjax").rglob("*.py")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "experiments").glob("*.py")}
    missing = sorted(wanted - listed)
    assert not missing, f"BUILD does not list {missing}; add them to the matching target"
    stale = sorted(p for p in listed if not (ROOT / p).exists())
    assert not stale, f"BUILD lists files that do not exist: {stale}"
