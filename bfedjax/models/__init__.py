"""bfedjax model zoo (Flax linen classifiers; params are plain pytrees, see ``models.apply``)."""

from bfedjax.models import apply
from bfedjax.models.apply import apply_fn_of, mc_predict_proba, train_apply_fn_of
from bfedjax.models.groups import client_architectures, parse_architectures
from bfedjax.models.fixup import FixupResNet9
from bfedjax.models.mobilenet import MobileNetV3Small
from bfedjax.models.resnet import ResNet20
from bfedjax.models.unet import UNet
from bfedjax.models.unet3d import UNet3D
from bfedjax.models.zoo import (
    COMPUTE_DTYPES,
    DROPOUT_MODELS,
    CNN1,
    CNN2,
    CNN2Trunk,
    FedRegCNN,
    MODELS,
    MLP,
    FolaCNN,
    McMahanCNN,
    LeNet,
    SEGMENTATION_HEADS,
    SEGMENTATION_MODELS,
    Logistic,
    compute_dtype_of,
    get_model,
    init_params,
    local_response_normalization,
    num_params,
)

__all__ = [
    "Logistic", "MLP", "FolaCNN", "LeNet", "CNN1", "CNN2", "CNN2Trunk", "FedRegCNN", "McMahanCNN", "ResNet20", "FixupResNet9", "MobileNetV3Small", "UNet", "UNet3D",
    "MODELS", "DROPOUT_MODELS", "SEGMENTATION_MODELS", "SEGMENTATION_HEADS", "COMPUTE_DTYPES", "compute_dtype_of",
    "get_model", "init_params", "num_params",
    "local_response_normalization", "client_architectures", "parse_architectures", "apply", "apply_fn_of",
    "train_apply_fn_of", "mc_predict_proba",
]
