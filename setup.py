"""bfedjax: Bayesian federated learning in JAX, one jitted round per step."""
from setuptools import find_packages, setup

setup(
    name="bfedjax",
    version="0.1.0",
    description="Bayesian federated learning in JAX: vmapped clients, one jitted round.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["bfedjax", "bfedjax.*", "experiments", "experiments.*"]),
    package_data={"experiments": ["configs/*.flags"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.30",
        "flax>=0.8",
        "optax>=0.2.5",
        "numpyro>=0.15",
        "chex>=0.1.86",
        "absl-py>=2.0",
        "numpy>=1.24",
        "scikit-learn>=1.3",
        "orbax-checkpoint>=0.5",
        "dp-accounting>=0.4",  # DP-SGD's privacy accountant (bfedjax.privacy.dp)
        "matplotlib>=3.7",  # reconstruction figures (bfedjax.privacy.save_reconstruction_png)
    ],
    extras_require={
        "tfds": ["tensorflow-datasets>=4.9.6", "array_record>=0.5"],
        # The PyTorch loop of experiments/bench.py. Pinned: an open range pulls a multi-GB CUDA build.
        "bench": ["torch==2.13.0"],
        "dev": [
            "pytest>=7",
            "pytest-xdist>=3",
            "tensorflow-datasets>=4.9.6",
            "array_record>=0.5",
            "mlxtend>=0.23",
        ],
    },
)
