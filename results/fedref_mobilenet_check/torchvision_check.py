"""bfedjax's MobileNetV3Small against torchvision's mobilenet_v3_small (FedRef's MNIST model), weights copied.

torchvision is not a bfedjax dependency, and the PyPI torchvision wheel's compiled operators do not load
against the CPU torch build the project pins; its models are pure Python, so this check stubs the
operators' registration module. Run (the output is torchvision_check.txt beside this file):

    python -m venv --system-site-packages /tmp/tvenv
    /tmp/tvenv/bin/pip download torchvision==0.28.0 --no-deps -d /tmp/tv28   # torchvision for torch 2.13
    /tmp/tvenv/bin/pip install --no-deps /tmp/tv28/torchvision-0.28.0-*.whl
    /tmp/tvenv/bin/python results/fedref_mobilenet_check/torchvision_check.py
"""
import sys
import types

sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

from bfedjax.models import get_model, init_params  # noqa: E402
from bfedjax.models.apply import apply_fn_of, train_apply_fn_of  # noqa: E402

jax.config.update("jax_enable_x64", True)
print("torch", torch.__version__, "torchvision", torchvision.__version__)
net = torchvision.models.mobilenet_v3_small()
print("torchvision mobilenet_v3_small parameters:", sum(p.numel() for p in net.parameters()))
net.classifier = torch.nn.Sequential(torch.nn.Linear(576, 10))  # FedRef's replacement
net = net.double()
print("with Linear(576, 10):", sum(p.numel() for p in net.parameters()))

model = get_model("mobilenet_v3_small", 10)
variables = init_params(model, (28, 28, 1), jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
# running statistics away from 0 and 1, so that eval mode checks them too
variables["batch_stats"] = jax.tree.map(lambda a: np.asarray(a) + rng.uniform(0.1, 0.5, a.shape),
                                        variables["batch_stats"])
print("bfedjax parameters:", sum(a.size for a in jax.tree.leaves(variables["params"])),
      "BatchNorm statistics:", sum(a.size for a in jax.tree.leaves(variables["batch_stats"])))

# torch modules in order, Flax leaves in order: (conv, bn) pairs and the SE convs, then the classifier
flax_units = [("stem",)] + [(f"bneck{i}",) for i in range(11)] + [("last",)]
torch_layers = [m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear))]


def flax_layers(params, stats):
    out = []

    def conv_bn(p, s):
        out.append(("conv", p["Conv_0"]["kernel"], None))
        out.append(("bn", (p["BatchNorm_0"]["scale"], p["BatchNorm_0"]["bias"]),
                    (s["BatchNorm_0"]["mean"], s["BatchNorm_0"]["var"])))

    conv_bn(params["stem"], stats["stem"])
    for i in range(11):
        p, s = params[f"bneck{i}"], stats[f"bneck{i}"]
        if "expand" in p:
            conv_bn(p["expand"], s["expand"])
        conv_bn(p["depthwise"], s["depthwise"])
        if "se" in p:
            out.append(("conv", p["se"]["fc1"]["kernel"], p["se"]["fc1"]["bias"]))
            out.append(("conv", p["se"]["fc2"]["kernel"], p["se"]["fc2"]["bias"]))
        conv_bn(p["project"], s["project"])
    conv_bn(params["last"], stats["last"])
    out.append(("linear", params["classifier"]["kernel"], params["classifier"]["bias"]))
    return out


pairs = list(zip(torch_layers, flax_layers(variables["params"], variables["batch_stats"]), strict=True))
init_stds = []
with torch.no_grad():
    for module, (kind, a, b) in pairs:
        if kind == "conv":
            init_stds.append(float(np.std(a)) / np.sqrt(2.0 / (a.shape[0] * a.shape[1] * a.shape[3])))
            module.weight.copy_(torch.tensor(np.asarray(a)).permute(3, 2, 0, 1))
            if b is not None:
                module.bias.copy_(torch.tensor(np.asarray(b)))
        elif kind == "bn":
            module.weight.copy_(torch.tensor(np.asarray(a[0]))), module.bias.copy_(torch.tensor(np.asarray(a[1])))
            module.running_mean.copy_(torch.tensor(np.asarray(b[0]))), module.running_var.copy_(torch.tensor(np.asarray(b[1])))
        else:
            module.weight.copy_(torch.tensor(np.asarray(a)).T), module.bias.copy_(torch.tensor(np.asarray(b)))
print(f"{len(pairs)} layers copied; conv kernel std / sqrt(2 / fan_out) over the {len(init_stds)} convolutions: "
      f"median {np.median(init_stds):.3f}, min {min(init_stds):.3f}, max {max(init_stds):.3f}")

x = rng.uniform(0, 1, (4, 28, 28, 1))
x_torch = F.interpolate(torch.tensor(x).permute(0, 3, 1, 2), size=(64, 64), mode="bilinear", align_corners=False,
                        antialias=True).repeat(1, 3, 1, 1)  # ToTensor -> Resize((64, 64)) -> grey to RGB
net.eval()
with torch.no_grad():
    want = net(x_torch).numpy()
got = np.asarray(apply_fn_of(model)(variables, x))
print("eval mode (running statistics): max |logit difference|", f"{np.abs(got - want).max():.2e}",
      "of max |logit|", f"{np.abs(want).max():.3f}")
net.train()
with torch.no_grad():
    want = net(x_torch).numpy()
got, updated = train_apply_fn_of(model)(variables, x, np.ones(4), jax.random.PRNGKey(1))
print("train mode (batch statistics): max |logit difference|", f"{np.abs(np.asarray(got) - want).max():.2e}",
      "of max |logit|", f"{np.abs(want).max():.3f}")
# running mean after one step: torch (1 - 0.01) * old + 0.01 * batch mean, the same rule as Flax's momentum 0.99
mean_t = net.features[0][1].running_mean.numpy()
mean_f = np.asarray(updated["batch_stats"]["stem"]["BatchNorm_0"]["mean"])
print("stem running mean after one training batch: max difference", f"{np.abs(mean_t - mean_f).max():.2e}")
