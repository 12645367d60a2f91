"""adaattn: fused attention kernels for PyTorch (CPU and CUDA, forward and backward)."""
from . import distributed, nn, precision, reference
from ._ops import ops
from .block_sparse import BlockSparseMask, block_sparse_attn
from .config import build_info, show_config
from .decode import flash_attn_with_kvcache, lazy_attn_with_kvcache, low_rank_attn_with_kvcache
from .flash import flash_attn, flash_attn_varlen
from .kvcache import KVCache, LowRankKVCache
from .lazy import LazyStats, lazy_attn, lazy_attn_varlen
from .linear import linear_attn
from .rank import (RankPlan, adaptive_rank_attn, low_rank_attn, rank_error_bound,
                   rank_error_estimate, rank_plan)

__all__ = ["BlockSparseMask", "KVCache", "LazyStats", "LowRankKVCache", "RankPlan",
           "adaptive_rank_attn", "block_sparse_attn", "build_info", "distributed", "flash_attn",
           "flash_attn_varlen", "flash_attn_with_kvcache", "lazy_attn", "lazy_attn_varlen",
           "lazy_attn_with_kvcache", "linear_attn", "low_rank_attn", "low_rank_attn_with_kvcache",
           "nn", "ops", "precision", "rank_error_bound", "rank_error_estimate", "rank_plan",
           "reference", "show_config"]
__version__ = "0.1.0"
