"""Mean-field variational inference on NumPyro for federated clients (Flipout, local reparameterisation or
reparameterisation)."""
from bfedjax.vi.layer_noise import (flipout_apply, flipout_interceptor, local_reparameterization_apply,
                                    local_reparameterization_interceptor)
from bfedjax.vi.meanfield import GRADIENT_ESTIMATORS, INIT_LOCS, OPTIMIZERS, MeanFieldConfig, MeanFieldVI

__all__ = ["GRADIENT_ESTIMATORS", "INIT_LOCS", "OPTIMIZERS", "MeanFieldConfig", "MeanFieldVI", "flipout_apply", "flipout_interceptor",
           "local_reparameterization_apply", "local_reparameterization_interceptor"]
