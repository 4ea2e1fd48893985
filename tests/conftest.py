"""Shared small fixtures: digits, a 5-client skewed split, a tiny MLP."""
import jax
import numpy as np
import pytest

import bfedjax as bf


@pytest.fixture(scope="session")
def digits():
    return bf.data.load("digits")


@pytest.fixture(scope="session")
def small_fed(digits):
    """5 clients over 500 digits, Dirichlet 0.5: ragged sizes, so padding is exercised."""
    parts = bf.data.partition(digits.y_train[:500], "dirichlet_per_class", 5, seed=0, alpha=0.5)
    return bf.data.stack_clients(digits.x_train[:500], digits.y_train[:500], parts,
                                 x_test=digits.x_test, y_test=digits.y_test, num_classes=10, name="digits")


@pytest.fixture(scope="session")
def tiny_model():
    return bf.models.get_model("mlp", 10, hidden=(16,))


@pytest.fixture(scope="session")
def tiny_params(tiny_model):
    return tiny_model.init(jax.random.PRNGKey(1), np.zeros((1, 8, 8, 1), np.float32))["params"]
