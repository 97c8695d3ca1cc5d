"""flash-attn-4-sm120: FlashAttention for consumer Blackwell (SM120/SM121) on mma.sync.

Load it through the Hugging Face ``kernels`` library::

    fa = kernels.get_kernel("<org>/flash-attn-4-sm120", version=1)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)

Importing this package registers its two torch.library ops (``<module>::fwd``/``::bwd``, for torch.compile) and
does nothing else: CuTe-DSL is imported, and kernels are compiled, on the first call that needs them.
"""

from . import ops  # noqa: F401 - registers the torch.library ops (for torch.compile); touches neither CUDA nor CuTe-DSL
from .block_sparse import (BlockSparseTensors, block_sparse_bwd_from_flex, block_sparse_from_flex,
                           block_sparse_from_mask)
from .dropout import dropout_mask
from .features import FEATURES
from .interface import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__version__ = "1.0.0"


def __getattr__(name):
    """``mods`` (the score/mask mod library) imports CuTe-DSL, so it loads on first access, not at import."""
    if name == "mods":
        import importlib

        return importlib.import_module(f"{__name__}.kernels.mods")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlockSparseTensors", "FEATURES", "__version__", "block_sparse_bwd_from_flex", "block_sparse_from_flex",
           "block_sparse_from_mask", "dropout_mask", "flash_attn_combine", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache"]
