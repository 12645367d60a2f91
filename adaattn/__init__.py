"""adaattn: fused attention kernels for PyTorch (CPU and CUDA, forward and backward)."""
from . import nn, reference
from ._ops import ops
from .flash import flash_attn

__all__ = ["flash_attn", "nn", "ops", "reference"]
__version__ = "0.1.0"
