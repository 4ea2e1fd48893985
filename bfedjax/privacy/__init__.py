"""Privacy: DP-SGD with its accountant, gradient-inversion attacks and the PSNR of what they recover."""
from bfedjax.privacy.dp import clip_per_example, client_epsilon, dp_epsilon, private_gradient
from bfedjax.privacy.inversion import (DISTANCES, Reconstruction, psnr, reconstruct, save_reconstruction_png,
                                       step_decay_lr, total_variation)

__all__ = ["DISTANCES", "Reconstruction", "clip_per_example", "client_epsilon", "dp_epsilon", "private_gradient",
           "psnr", "reconstruct", "save_reconstruction_png", "step_decay_lr", "total_variation"]
