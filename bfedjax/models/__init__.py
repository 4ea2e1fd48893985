"""bfedjax model zoo (Flax linen classifiers; params are plain pytrees)."""

from bfedjax.models.zoo import (
    MODELS,
    MLP,
    FolaCNN,
    LeNet,
    Logistic,
    get_model,
    init_params,
    num_params,
)

__all__ = [
    "Logistic", "MLP", "FolaCNN", "LeNet",
    "MODELS", "get_model", "init_params", "num_params",
]
