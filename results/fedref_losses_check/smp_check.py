"""bfedjax's FedRef losses against segmentation_models_pytorch 0.5.0's own DiceLoss and FocalLoss.

smp's top-level package imports timm and torchvision (a CUDA torch from PyPI), so this loads only its
``losses`` subpackage (which imports torch alone) from the wheel:

    pip download --no-deps segmentation-models-pytorch==0.5.0 -d /tmp/smp
    python -m zipfile -e /tmp/smp/segmentation_models_pytorch-0.5.0-py3-none-any.whl /tmp/smp/x
    python results/fedref_losses_check/smp_check.py /tmp/smp/x > results/fedref_losses_check/smp_check.txt
"""
import sys
import types

import jax
import numpy as np
import torch

root = sys.argv[1]
package = types.ModuleType("segmentation_models_pytorch")  # stands in for the top-level __init__ (timm, ...)
package.__path__ = [f"{root}/segmentation_models_pytorch"]
sys.modules["segmentation_models_pytorch"] = package
from segmentation_models_pytorch.losses import DiceLoss, FocalLoss  # noqa: E402

from bfedjax.metrics import segmentation as S  # noqa: E402

dice = DiceLoss(mode="multiclass", from_logits=True, smooth=1e-5, eps=1e-7)  # the authors' settings
focal = FocalLoss(mode="multiclass", alpha=0.1, gamma=4.5, normalized=True)
rng = np.random.default_rng(0)
worst = 0.0
for case, (shape, classes, scale) in enumerate([((2, 9, 11), 4, 2.0), ((3, 5, 6, 7), 4, 3.0), ((2, 16, 16), 2, 1.0),
                                                ((1, 8, 8), 4, 8.0), ((1, 8, 8), 4, 12.0)]):
    logits = rng.normal(scale=scale, size=shape + (classes,)).astype(np.float32)
    masks = rng.integers(0, classes - (case == 3), size=shape)  # case 3: the last class absent from the masks
    if case == 4:  # one pixel of class 3, confidently missed: smp 0.5.0's Dice smoothing shows
        masks = np.zeros(shape, np.int64)
        masks[0, 3, 3] = 3
        logits[0, 3, 3, 3] = -12.0
    torch_logits = torch.tensor(np.moveaxis(logits, -1, 1), requires_grad=True)  # [B, C, *S]
    torch_masks = torch.tensor(masks)
    for name, ours, theirs in [("dice", S.authors_dice_loss, dice), ("focal", S.authors_focal_loss, focal),
                               ("dice+focal", S.dice_focal_loss, lambda a, b: dice(a, b) + focal(a, b))]:
        ref = theirs(torch_logits, torch_masks)
        grad_ref = np.moveaxis(torch.autograd.grad(ref, torch_logits)[0].numpy(), 1, -1)
        ref = ref.item()
        value, grad = jax.value_and_grad(ours)(logits, masks)
        rel = abs(float(value) - ref) / abs(ref)
        grel = float(np.max(np.abs(np.asarray(grad) - grad_ref)) / np.max(np.abs(grad_ref)))
        worst = max(worst, rel, grel)
        print(f"case {case} {shape} C={classes} {name:10s} smp {ref:.8g} bfedjax {float(value):.8g} "
              f"rel. diff {rel:.1e}; gradient max diff / max {grel:.1e}")
    # One binary logit z as [0, z] against smp on the two channels [0, z].
    z = logits[..., 1]
    two = torch.tensor(np.stack([np.zeros_like(z), z], axis=1), requires_grad=True)
    binary = (masks > 0).astype(np.int64)
    for name, ours, theirs in [("dice", S.authors_dice_loss, dice), ("focal", S.authors_focal_loss, focal)]:
        ref, value = theirs(two, torch.tensor(binary)).item(), float(ours(z, binary))
        rel = abs(value - ref) / abs(ref)
        worst = max(worst, rel)
        print(f"case {case} one logit [0, z]  {name:10s} smp {ref:.8g} bfedjax {value:.8g} rel. diff {rel:.1e}")
    # The authors' reported "Dice": 1 - DiceLoss on the sigmoid of the network's output (an activation twice).
    with torch.no_grad():
        ref = 1.0 - dice(torch.sigmoid(torch_logits), torch_masks).item()
    value = float(S.authors_soft_dice(logits, masks))
    rel = abs(value - ref) / abs(ref)
    worst = max(worst, rel)
    print(f"case {case} authors_soft_dice  smp 1 - DiceLoss(sigmoid) {ref:.8g} bfedjax {value:.8g} rel. diff {rel:.1e}")
print(f"worst relative difference {worst:.1e}")
assert worst < 1e-5, worst
