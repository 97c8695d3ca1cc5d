"""Input validation for the public API (host only).

Every check raises before any kernel launch, with a message that names the argument, the value and the limit.
Nothing here uses ``assert``: the checks stay under ``python -O``.
"""

from __future__ import annotations

import math
import torch

from .config import HEAD_DIMS, MAX_GRID_YZ, MAX_SEQLEN, WINDOW_UNBOUNDED, supported_head_dim_pairs, table_version

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = DTYPE_NAMES
_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP32_MAX = 3.4028234663852886e38


def _fail(msg: str):
    raise ValueError(msg)


def check_tensor(name: str, t, rank: int, device: torch.device | None = None) -> None:
    """An fp16/bf16 CUDA tensor of ``rank`` dims on ``device``, last dim contiguous, rows 16-byte aligned.
    (Runs on every call: the common case is a handful of attribute reads.)"""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        _fail(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        _fail(f"{name} has dtype {t.dtype}; supported: torch.float16, torch.bfloat16")
    if not t.is_cuda:
        _fail(f"{name} is on {t.device}; flash-attn-4-sm120 needs CUDA tensors")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}; put all inputs on one device")
    strides = t.stride()
    if strides[-1] != 1:
        _fail(f"{name} must be contiguous in its last dimension (stride(-1) = {strides[-1]}); call .contiguous()")
    # both dtypes are 2 bytes: 8 elements per 16-byte vector
    misaligned = t.data_ptr() % 16 != 0
    if not misaligned:
        for s in strides[:-1]:
            if s % 8:
                misaligned = t.numel() > 0
                break
    if misaligned:
        _fail(
            f"{name} rows must be 16-byte aligned (data_ptr % 16 == 0 and every stride but the last a multiple of "
            f"8 elements); got strides {tuple(strides)}, data_ptr % 16 = {t.data_ptr() % 16}; call .contiguous()"
        )


def check_index_tensor(name: str, t, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor of dtype int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        _fail(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        _fail(f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q is on {device}")
    if t.stride(0) != 1:
        _fail(f"{name} must be contiguous")


def check_head_dims(d: int, dv: int) -> None:
    if d not in HEAD_DIMS:
        _fail(f"head_dim={d} is not supported; supported head dims: {HEAD_DIMS}")
    if dv not in HEAD_DIMS:
        _fail(f"head_dim_v={dv} (v.shape[-1]) is not supported; supported: {HEAD_DIMS}")
    if (d, dv) not in _supported_pairs():
        _fail(
            f"head_dim={d} with head_dim_v={dv} is not supported: pairs with head_dim_v <= head_dim are "
            f"({', '.join(f'{a}/{b}' for a, b in supported_head_dim_pairs())})"
        )


def _supported_pairs() -> frozenset:
    version = table_version()
    cached = _PAIRS_CACHE.get(version)
    if cached is None:
        cached = _PAIRS_CACHE[version] = frozenset(supported_head_dim_pairs())
    return cached


_PAIRS_CACHE: dict = {}


def check_heads(hq: int, hkv: int, hkv_v: int) -> None:
    if hkv != hkv_v:
        _fail(f"k has {hkv} heads but v has {hkv_v}; they must match")
    if hkv == 0 or hq % hkv != 0:
        _fail(f"the number of query heads ({hq}) must be a positive multiple of the number of KV heads ({hkv})")
    if hq > MAX_GRID_YZ:  # the forward and the dQ kernel put query heads on grid.y
        _fail(f"{hq} query heads exceed the supported maximum {MAX_GRID_YZ} (CUDA grid limit); split the heads "
              "over several calls")


def resolve_window(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) with WINDOW_UNBOUNDED for an unbounded side.  None or a negative value means unbounded,
    as in FlashAttention.  causal=True fixes right = 0, whatever window_size[1] says (flash-attn-4 and
    FlashAttention-2 define it so, and transformers passes ``causal=True, window_size=(w - 1, w - 1)``);
    ``(None, 0)`` without causal is the same causal mask."""
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail(f"window_size must be a pair (left, right), got {window_size!r}")
    bounds = []
    for side, w in zip(("left", "right"), window_size):
        if w is None or (isinstance(w, int) and w < 0):
            bounds.append(WINDOW_UNBOUNDED)
        elif isinstance(w, bool) or not isinstance(w, int):
            _fail(f"window_size {side} bound must be an int or None, got {w!r}")
        else:
            bounds.append(min(w, WINDOW_UNBOUNDED))
    left, right = bounds
    if causal:  # FlashAttention's definition (flash-attn-4 b36, FA2): causal fixes the right bound to 0
        right = 0
    return left, right


def check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    try:
        softmax_scale = float(softmax_scale)
    except (TypeError, ValueError):
        _fail(f"softmax_scale must be a number, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    softcap = 0.0 if softcap is None else float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    # the kernels get softmax_scale * log2(e), softcap * log2(e) and softmax_scale / softcap as fp32 values
    derived = [softmax_scale * 1.4426950408889634]
    if softcap > 0:
        derived += [softcap * 1.4426950408889634, softmax_scale / softcap]
    if max(derived) > _FP32_MAX:
        _fail(f"softmax_scale={softmax_scale} with softcap={softcap} overflows fp32 in the kernel "
              f"(softmax_scale * log2(e), softcap * log2(e) and softmax_scale / softcap must stay below {_FP32_MAX:.3g})")
    return softmax_scale, softcap


def check_sink(sink, num_heads: int, device: torch.device):
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        _fail(f"learnable_sink must be a torch.Tensor of shape ({num_heads},), got {type(sink).__name__}")
    if sink.shape != (num_heads,):
        _fail(f"learnable_sink must have shape ({num_heads},) (one logit per query head), got {tuple(sink.shape)}")
    if sink.dtype not in _SINK_DTYPES:
        _fail(f"learnable_sink dtype {sink.dtype} is not supported; use float32, bfloat16 or float16")
    if sink.device != device:
        _fail(f"learnable_sink is on {sink.device} but q is on {device}")
    return sink.detach().to(torch.float32).contiguous()


def check_lengths(**lengths: int) -> None:
    for name, n in lengths.items():
        if n > MAX_SEQLEN:
            _fail(f"{name}={n} exceeds the supported maximum {MAX_SEQLEN}")


def check_batch(batch: int) -> None:
    if batch > MAX_GRID_YZ:
        _fail(f"batch size {batch} exceeds the supported maximum {MAX_GRID_YZ} (CUDA grid limit)")


def check_page_table(page_table, k, v, batch: int, device: torch.device, cu_seqlens_k) -> tuple[int, int, int]:
    """Paged K/V (flash-attn-4's ``page_table``): k/v (num_pages, page_size, Hkv, D), page_table int32
    (batch, max_pages_per_seq).  Returns (num_pages, page_size, max_pages_per_seq)."""
    if cu_seqlens_k is not None:
        _fail("page_table cannot be combined with cu_seqlens_k: with paged K/V the lengths come from seqused_k "
              "(leave cu_seqlens_k=None)")
    if not isinstance(page_table, torch.Tensor):
        _fail(f"page_table must be a torch.Tensor of dtype int32, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        _fail(f"page_table must have dtype torch.int32, got {page_table.dtype}")
    if page_table.dim() != 2:
        _fail(f"page_table must be 2-D (batch, max_pages_per_seq), got shape {tuple(page_table.shape)}")
    if page_table.shape[0] != batch:
        _fail(f"page_table has {page_table.shape[0]} rows but the batch is {batch}")
    if page_table.device != device:
        _fail(f"page_table is on {page_table.device} but q is on {device}")
    if page_table.stride(-1) != 1 and page_table.shape[-1] > 1:
        _fail(f"page_table must be contiguous in its last dimension (strides {tuple(page_table.stride())})")
    if tuple(k.shape[:2]) != tuple(v.shape[:2]):
        _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same pages: (num_pages, page_size, Hkv, D) "
              f"with equal num_pages and page_size")
    num_pages, page_size = k.shape[0], k.shape[1]
    if page_size < 1:
        _fail(f"page_size (k.shape[1]) must be >= 1, got {page_size}")
    if num_pages < 1:
        _fail("k/v hold no pages (k.shape[0] == 0); a paged cache needs at least one page")
    max_pages = page_table.shape[1]
    if max_pages * page_size > MAX_SEQLEN:
        _fail(f"max_pages_per_seq * page_size = {max_pages} * {page_size} exceeds the supported maximum sequence "
              f"length {MAX_SEQLEN}")
    return num_pages, page_size, max_pages
