"""Run by tests/test_experiments.py: ``python tests/tfds_mock_run.py FLAGS...`` is ``python -m experiments.run
FLAGS...`` with every TFDS data set replaced by ``tfds.testing.mock_data`` (random examples with the real
shapes and dtypes), so the TFDS-only presets run end to end without the data."""
import sys

import tensorflow_datasets as tfds

from experiments import errors, run

if __name__ == "__main__":
    with tfds.testing.mock_data(num_examples=400):
        sys.argv = ["experiments.run", *sys.argv[1:]]
        errors.run(run.main)
