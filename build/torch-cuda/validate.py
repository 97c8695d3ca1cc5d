"""Input validation for the public API (host only).

Every check raises before any kernel launch, with a message that names the argument, the value and the limit.
Nothing here uses ``assert``: the checks stay under ``python -O``.
"""

from __future__ import annotations

import math
import os

import torch

from .compat import refuse
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
    # both dtypes are 2 bytes: 8 elements per 16-byte vector.  Strides are >= 0, so every stride but the last is a
    # multiple of 8 exactly when their bitwise OR (ranks 3 and 4, inline) or their gcd is; a misaligned stride
    # matters only when the tensor holds elements
    if rank == 4:
        lead = strides[0] | strides[1] | strides[2]
    elif rank == 3:
        lead = strides[0] | strides[1]
    else:
        lead = math.gcd(*strides[:-1])
    if t.data_ptr() % 16 or (lead & 7 and t.numel() > 0):
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
    # the bounds are read inline (this runs on every call); anything but None or an int takes _bound
    if window_size is None:
        left = right = WINDOW_UNBOUNDED
    else:
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            _fail(f"window_size must be a pair (left, right), got {window_size!r}")
        left, right = window_size
        if left is None:
            left = WINDOW_UNBOUNDED
        elif left.__class__ is not int:
            left = _bound("left", left)
        elif left < 0 or left > WINDOW_UNBOUNDED:  # negative: unbounded, as in FlashAttention
            left = WINDOW_UNBOUNDED
        if right is None:
            right = WINDOW_UNBOUNDED
        elif right.__class__ is not int:
            right = _bound("right", right)
        elif right < 0 or right > WINDOW_UNBOUNDED:  # negative: unbounded, as in FlashAttention
            right = WINDOW_UNBOUNDED
    if causal:  # FlashAttention's definition (flash-attn-4 b36, FA2): causal fixes the right bound to 0
        right = 0
    return left, right


def _bound(side: str, w) -> int:
    """One window bound that is neither None nor exactly an int: a negative int (a subclass) is unbounded, another
    int is capped at WINDOW_UNBOUNDED; a bool or a non-int raises."""
    if isinstance(w, int) and w < 0:
        return WINDOW_UNBOUNDED
    if isinstance(w, bool) or not isinstance(w, int):
        _fail(f"window_size {side} bound must be an int or None, got {w!r}")
    return min(w, WINDOW_UNBOUNDED)


# a scale below this passes every check of check_scalars without a softcap (scale * log2(e) stays below fp32's max)
_PLAIN_SCALE_MAX = 1e30


def check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    cls = softcap.__class__
    if softcap is None or (cls is float or cls is int) and softcap == 0:  # no softcap: the common call, inline
        if softmax_scale is None:
            return 1.0 / math.sqrt(head_dim), 0.0 if softcap is None else float(softcap)
        if softmax_scale.__class__ is float and 0.0 < softmax_scale < _PLAIN_SCALE_MAX:
            return softmax_scale, 0.0 if softcap is None else float(softcap)
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


def check_page_table(page_table, k, v, batch: int, device: torch.device) -> tuple[int, int, int]:
    """Paged K/V (flash-attn-4's ``page_table``): k/v (num_pages, page_size, Hkv, D), page_table int32
    (batch, max_pages_per_seq).  Returns (num_pages, page_size, max_pages_per_seq).  (With cu_seqlens_k it is
    refused before: compat.py.)"""
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


# ---- one forward call: tensors, lengths, the opt-in debug checks of metadata values ---------------------------
_DEBUG_ENV: list = []  # [bool] once read


def debug_checks_enabled(flag) -> bool:
    """``flag`` (the keyword) wins when given; otherwise FA4_SM120_DEBUG_CHECKS=1, read once per process."""
    if flag is not None:
        if not isinstance(flag, bool):
            raise ValueError(f"debug_checks must be None, True or False, got {flag!r}")
        return flag
    if not _DEBUG_ENV:
        _DEBUG_ENV.append(os.environ.get("FA4_SM120_DEBUG_CHECKS", "0") == "1")
    return _DEBUG_ENV[0]


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- lengths ---------------------------------------------------------------------------------------------------
def max_len(cu_seqlens, seqused, rows: int, name: str, max_seqlen) -> int:
    """Longest sequence of q or k, for the grid.  Given ``max_seqlen`` is trusted (clamped to the rows that
    exist); dense inputs use their static length; otherwise it is computed on the device and read once."""
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)):
            # integer-valued numbers (numpy ints, 7.0) are accepted; 2.5, a tensor or a string is not
            try:
                as_int = int(max_seqlen)
                exact = not isinstance(max_seqlen, torch.Tensor) and as_int == max_seqlen
            except (TypeError, ValueError, OverflowError):
                exact = False
            if not exact:
                raise ValueError(f"max_seqlen_{name} must be an int, got {max_seqlen!r}")
            max_seqlen = as_int
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen_{name} must be >= 0, got {max_seqlen}")
        return min(int(max_seqlen), rows)
    if cu_seqlens is None:
        return rows
    if capturing():
        refuse("varlen_capture_max_seqlen", which=name)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).clamp_(min=0)
    if seqused is not None:
        lens = torch.minimum(lens, seqused.clamp(min=0))
    return min(int(lens.max().item()) if lens.numel() else 0, rows)  # the documented single read


def debug_check_lengths(cu_seqlens, seqused, batch: int, static_len: int, total: int, name: str, max_seqlen):
    """Opt-in host checks of metadata values (one device->host copy); raises ValueError naming the lie."""
    if cu_seqlens is None and seqused is None:
        return
    if capturing():
        refuse("debug_checks_capture", prefix="", what="cu_seqlens/seqused", advice="; turn them off for the capture")
    vals = torch.cat([t for t in (cu_seqlens, seqused) if t is not None]).tolist()
    if cu_seqlens is not None:
        cu, vals = vals[: batch + 1], vals[batch + 1:]
        if cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(
                f"cu_seqlens_{name} must be non-decreasing, start >= 0 and end <= {total} (the rows of {name}); "
                f"got {cu[:8]}{'...' if len(cu) > 8 else ''}"
            )
        lens = [b - a for a, b in zip(cu, cu[1:])]
    else:
        lens = [static_len] * batch
    if seqused is not None:
        bad = [(i, u, n) for i, (u, n) in enumerate(zip(vals[:batch], lens)) if not 0 <= u <= n]
        if bad:
            i, u, n = bad[0]
            raise ValueError(f"seqused_{name}[{i}]={u} must be in [0, {n}] (the length of that sequence)")
        lens = vals[:batch]
    longest = max(lens, default=0)
    if max_seqlen is not None and int(max_seqlen) < longest:
        raise ValueError(f"max_seqlen_{name}={max_seqlen} is smaller than the longest sequence ({longest})")


def debug_check_pages(page_table, seqused_k, page_size: int, num_pages: int) -> None:
    """Opt-in host check of a page table (one device->host copy): every page a sequence uses (the first
    ceil(seqused_k / page_size) entries of its row; the rest may be padding such as -1) is in [0, num_pages)."""
    if capturing():
        refuse("debug_checks_capture", prefix="", what="page_table", advice="; turn them off for the capture")
    batch, max_pages = page_table.shape
    if batch == 0 or max_pages == 0:
        return
    if seqused_k is None:
        used = torch.full((batch,), max_pages, dtype=torch.int64, device=page_table.device)
    else:
        used = (seqused_k.long().clamp(0, max_pages * page_size) + page_size - 1) // page_size
    cols = torch.arange(max_pages, device=page_table.device)
    bad = (cols[None, :] < used[:, None]) & ((page_table < 0) | (page_table >= num_pages))
    where = bad.nonzero()
    if where.numel():
        b, c = where[0].tolist()
        raise ValueError(f"page_table[{b}, {c}]={int(page_table[b, c])} is outside [0, {num_pages}) (the pages of "
                         f"k/v) and sequence {b} uses that entry (seqused_k gives it {int(used[b])} pages)")


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table=None):
    """Rank/dtype/device/stride/shape checks of one call (raise before any launch); returns batch.  A page table
    with cu_seqlens_k never reaches here (compat.py refuses the pair)."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    check_tensor("q", q, 3 if varlen_q else 4)
    dev = q.device
    check_tensor("k", k, 3 if varlen_k else 4, dev)
    check_tensor("v", v, 3 if varlen_k else 4, dev)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape  # read once (each .shape builds a torch.Size)
    d, dv = qs[-1], vs[-1]
    check_head_dims(d, dv)
    if ks[-1] != d:
        raise ValueError(f"k.shape[-1]={ks[-1]} must equal q.shape[-1]={d}")
    check_heads(qs[-2], ks[-2], vs[-2])
    if varlen_q:
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
            raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of shape (batch + 1,), got "
                             f"{type(cu_seqlens_q).__name__} {tuple(getattr(cu_seqlens_q, 'shape', ()))}")
        batch = cu_seqlens_q.shape[0] - 1
        if batch < 0:
            raise ValueError("cu_seqlens_q must have shape (batch + 1,) with batch >= 0, got shape (0,)")
    else:
        batch = qs[0]
    if page_table is not None:
        check_page_table(page_table, k, v, batch, dev)
    elif varlen_k:
        if ks[0] != vs[0]:
            raise ValueError(f"k and v must have the same number of tokens, got {ks[0]} and {vs[0]}")
    elif ks[:2] != vs[:2] or ks[0] != batch:
        raise ValueError(f"k {tuple(ks)} and v {tuple(vs)} must have batch {batch} and equal sequence lengths")
    if varlen_q:
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, batch + 1, dev)
    if varlen_k:
        check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, dev)
    if seqused_q is not None:
        check_index_tensor("seqused_q", seqused_q, batch, dev)
    if seqused_k is not None:
        check_index_tensor("seqused_k", seqused_k, batch, dev)
    if batch > MAX_GRID_YZ:
        check_batch(batch)
    seqlen_q, seqlen_k = qs[0] if varlen_q else qs[1], ks[0] if varlen_k else ks[1]
    if seqlen_q > MAX_SEQLEN or seqlen_k > MAX_SEQLEN:
        check_lengths(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    return batch


def host_values(q, k, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_size, softcap, debug_checks=None, page_table=None) -> tuple:
    """(scale, softcap, left, right, windowed, batch, max_q, max_k) of a call (plan.FwdMeta's first fields), without
    reading device memory when the caller gave what FlashAttention asks for.  With ``page_table`` the k extent is
    max_pages_per_seq * page_size.  The debug checks (``debug_checks_enabled``) read the metadata here."""
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        rows_q = seqlen_q_static = q.shape[0]
    else:
        batch, seqlen_q_static = q.shape[0], q.shape[1]
        rows_q = seqlen_q_static
    rows_k = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    if page_table is not None:
        rows_k = page_table.shape[1] * k.shape[1]
    scale, softcap = check_scalars(softmax_scale, softcap, q.shape[-1])
    left, right = resolve_window(causal, window_size)
    if (cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_q is not None or seqused_k is not None
            or page_table is not None) and debug_checks_enabled(debug_checks):
        debug_check_lengths(cu_seqlens_q, seqused_q, batch, seqlen_q_static, q.shape[0], "q", max_seqlen_q)
        debug_check_lengths(cu_seqlens_k, seqused_k, batch, rows_k, k.shape[0], "k", max_seqlen_k)
        if page_table is not None:
            debug_check_pages(page_table, seqused_k, k.shape[1], k.shape[0])
    max_q = max_len(cu_seqlens_q, seqused_q, rows_q, "q", max_seqlen_q)
    max_k = max_len(cu_seqlens_k, seqused_k, rows_k, "k", max_seqlen_k)
    windowed = causal or left != WINDOW_UNBOUNDED or right != WINDOW_UNBOUNDED
    return scale, softcap, left, right, windowed, batch, max_q, max_k


def check_forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_size, softcap, learnable_sink, debug_checks, page_table) -> tuple:
    """The validation of one forward call, in one place: tensors (``check_inputs``), the sink, then the host values
    (``host_values``).  Returns (sink as fp32 or None, host values)."""
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    sink = check_sink(learnable_sink, q.shape[-2], q.device)
    return sink, host_values(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                             seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                             debug_checks=debug_checks, page_table=page_table)
