"""Mean-field variational inference on NumPyro for federated clients (Flipout or reparameterisation)."""
from bfedjax.vi.flipout import flipout_apply, flipout_interceptor
from bfedjax.vi.meanfield import GRADIENT_ESTIMATORS, MeanFieldConfig, MeanFieldVI

__all__ = ["GRADIENT_ESTIMATORS", "MeanFieldConfig", "MeanFieldVI", "flipout_apply", "flipout_interceptor"]
