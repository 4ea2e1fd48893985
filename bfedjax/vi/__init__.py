"""Mean-field variational inference on NumPyro for federated clients."""
from bfedjax.vi.meanfield import MeanFieldConfig, MeanFieldVI

__all__ = ["MeanFieldConfig", "MeanFieldVI"]
