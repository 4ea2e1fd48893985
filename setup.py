"""bfedjax: Bayesian federated learning in JAX, one jitted round per step."""
from setuptools import find_packages, setup

CHECKPOINT = ["orbax-checkpoint>=0.5"]
DP = ["dp-accounting>=0.4"]
PLOTS = ["matplotlib>=3.7"]
FETS = ["nibabel>=5"]  # reads the FeTS NIfTI volumes (bfedjax.data.load_fets)
TFDS = ["tensorflow-datasets>=4.9.6", "array_record>=0.5"]
COMPILE_CACHE = ["filelock>=3.12"]  # bounds the size of JAX's compilation cache (bfedjax.core.compile_cache)
LOGGING = ["tensorboardX>=2.6", "tqdm>=4.66"]  # --tensorboard event files; progress bar with an ETA on a terminal
FLOWER = ["flwr>=1.42"]  # bfedjax.flower: any algorithm as a Flower strategy + ClientApp
NOTEBOOKS = ["nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"]  # tests/test_colab.py executes colab/*.ipynb
DOCS = ["sphinx>=8"]  # docs/: `make docs` builds the API site with warnings as errors
# The PyTorch rounds of experiments/bench.py (loop and torch.func). Pinned: an open range pulls a multi-GB CUDA build.
BENCH = ["torch==2.13.0"]

setup(
    name="bfedjax",
    version="0.1.0",
    description="Bayesian federated learning in JAX: vmapped clients, one jitted round.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bfedjax", "bfedjax.*", "experiments", "experiments.*"]),
    package_data={"experiments": ["configs/*.flags", "configs/*/*.flags"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.30",
        "flax>=0.8",
        "optax>=0.2.5",
        "numpyro>=0.15",
        "chex>=0.1.86",
        "absl-py>=2.0",
        "numpy>=1.24",
        "scikit-learn>=1.3",  # the offline digits data set
    ],
    # Optional features, imported where they are used (bfedjax.optional names the extra when one is missing).
    extras_require={
        "checkpoint": CHECKPOINT,  # bfedjax.checkpoint: round checkpoints, simulate(checkpoint_dir=...)
        "dp": DP,  # DP-SGD's privacy accountant (bfedjax.privacy.dp_epsilon)
        "plots": PLOTS,  # figures (bfedjax.privacy.save_reconstruction_png)
        "tfds": TFDS,
        "fets": FETS,
        "logging": LOGGING,
        "flower": FLOWER,
        "docs": DOCS,
        "experiments": CHECKPOINT + DP + PLOTS + LOGGING + COMPILE_CACHE,  # what the binaries in experiments/ use
        "bench": BENCH,
        "dev": CHECKPOINT + DP + PLOTS + LOGGING + COMPILE_CACHE + TFDS + FETS + FLOWER + NOTEBOOKS + DOCS + BENCH + ["pytest>=7", "pytest-xdist>=3", "mlxtend>=0.23", "hypothesis>=6.100",
                "pillow>=10"],  # pillow: the oracle of tests/test_autoaugment.py (bfedjax.data.pil_ops)
    },
)
