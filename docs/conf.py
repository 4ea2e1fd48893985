"""Sphinx configuration of the bfedjax documentation (``make docs``: HTML with warnings as errors).

The API pages are autodoc'd from the installed (editable) package; no page needs the network
at build time (MathJax is loaded by the reader's browser).
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "bfedjax"
author = "bfedjax authors"
copyright = "2025, bfedjax authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []
html_theme_options = {"description": "Bayesian federated learning in JAX", "fixed_sidebar": True}

# The docstrings are plain reST / Google style with ``Args:`` and ``Returns:`` sections.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # dataclass and NamedTuple fields ("Attributes:") as a field list, not duplicate objects
napoleon_custom_sections = [("Optional hooks", "params_style")]  # core.Algorithm's docstring
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False, "no-value": True}
autosummary_generate = False  # the API pages list their members by hand: no generated stub files in docs/
