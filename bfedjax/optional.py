"""Optional dependencies: imported where a feature needs them, with the extra that installs them named."""
from __future__ import annotations

import importlib

EXTRAS = {
    "orbax.checkpoint": ("checkpoint", "round checkpoints"),
    "dp_accounting": ("dp", "DP-SGD's privacy accountant"),
    "matplotlib": ("plots", "figures"),
    "tensorflow_datasets": ("tfds", "TFDS data sets"),
    "flwr": ("flower", "Flower deployment (bfedjax.flower)"),
    "filelock": ("experiments", "the size bound of bfedjax.core.compile_cache"),
}


def require(module: str):
    """Imports ``module`` or raises ``ImportError`` with the ``pip install 'bfedjax[extra]'`` that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra, feature = EXTRAS[module]
        raise ImportError(f"{module} is not installed ({feature}); fix: pip install 'bfedjax[{extra}]' "
                          f"(from a clone: pip install -e '.[{extra}]')") from err


__all__ = ["EXTRAS", "require"]
