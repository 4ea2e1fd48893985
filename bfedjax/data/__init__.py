"""Data sets and client partitioning for federated experiments."""

from bfedjax.data.sources import (DATASETS, EMNIST_CONFIGS, PIXELS, Dataset, DataDirNotFoundError,
                                  DataUnavailableError, available, holdout, load)
from bfedjax.data.validate import NonFiniteInputsWarning, check_dataset
from bfedjax.data.partition import (
    PARTITIONERS,
    class_groups,
    describe,
    dirichlet_niid_bench,
    dirichlet_per_class,
    dirichlet_per_client,
    dirichlet_train_test,
    iid,
    partition,
    power_law,
    shards,
    single_class,
)
from bfedjax.data.federated import FederatedData, from_partition, join_tasks, stack_clients
from bfedjax.data.augment import AUGMENTATIONS, augmentation, augmented, random_crop_flip, random_shift_flip
from bfedjax.data.autoaugment import autoaugment_cutout, cutout
from bfedjax.data.segmentation import foreground, institution_parts, load_drive, load_fets, load_fets_volumes, vessels

__all__ = ["DATASETS", "EMNIST_CONFIGS", "PIXELS", "Dataset", "DataDirNotFoundError", "DataUnavailableError",
           "NonFiniteInputsWarning",
           "check_dataset", "available", "holdout", "load", "PARTITIONERS", "class_groups", "describe",
           "dirichlet_niid_bench", "dirichlet_per_class", "dirichlet_per_client", "dirichlet_train_test", "iid", "partition", "power_law", "shards", "single_class",
           "FederatedData", "from_partition", "join_tasks", "stack_clients", "AUGMENTATIONS", "augmentation", "augmented", "autoaugment_cutout", "cutout", "random_crop_flip", "random_shift_flip",
           "load_drive", "load_fets", "load_fets_volumes", "institution_parts", "vessels", "foreground"]
