"""Host dispatch: the one forward path behind every entry point (the public functions, autograd and the
torch.library ops all call ``run_forward``, and ``dispatch_bwd.run_backward`` for gradients; none of them imports
another).

Per call, only what needs the tensors' metadata runs in Python: shape/dtype/stride checks, output allocation and
the launch.  Everything that depends only on the configuration — tile choice, kernel configs, the compiled
launcher, the backward's feasibility — is memoised in a plan keyed on a small tuple of flags.

No device->host synchronisation: dense calls never read device memory on the host, and varlen calls do not when
``max_seqlen_q/k`` are given (FlashAttention's API asks for them).  When one is missing it is computed on the
device and read once (one sync), and under CUDA-graph capture it is required.  ``cu_seqlens``/``seqused``
values are the caller's contract, as in FlashAttention; the kernels clamp every row they touch to the tensors
they were given, so a lie gives wrong numbers but never an out-of-bounds access.  ``FA4_SM120_DEBUG_CHECKS=1``
(read once, at the first varlen call) or ``debug_checks=True`` checks those values on the host and names the lie.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from . import block_sparse as BS
from . import dropout as D
from . import splitkv as SK
from . import validate as V
from .arguments import FWD_ARGS
from .device import device_caps
from .launch import compiled_kernel as _kernel, launch as _launch, sm_count
from .config import (
    FwdKernelConfig,
    MAX_SEQLEN,
    dropout_fwd_tile,
    select_fwd_tile,
    split_tile,
    mods_dropout_fwd_tile,
    mods_tile,
    paged_tma_tile,
    select_sparse_tile,
    table_version,
)
from .config_bwd import select_bwd_config, select_dq_config
from .config_decode import DECODE_MAX_ROWS, decode_rows, decode_tile

_LOG2_E = math.log2(math.e)
PAGED_GRAD_ERROR = (
    "paged K/V (page_table) is inference-only: the backward does not read pages. Call it under torch.no_grad() "
    "or with tensors that do not require grad (got q, k, v or learnable_sink with requires_grad=True)"
)
PAGED_DROPOUT_ERROR = (
    "dropout_p={p} with paged K/V (page_table): paged K/V is inference-only and has no dropout; pass dropout_p=0"
)
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


@dataclass(frozen=True)
class FwdMeta:
    """What the backward needs besides the saved tensors (host values of one forward call)."""

    scale: float
    softcap: float
    left: int
    right: int
    windowed: bool
    batch: int
    max_q: int
    max_k: int
    sparse: object = None  # block_sparse.SparseGrad of a block-sparse call that needs grad
    dropout: D.DropoutArgs | None = None  # p > 0 only; the backward reuses its seed and offset
    mods: object = None  # modspec.ModSpec of the call (with score_mod_bwd when it needs grad), or None
    # the backward runs the atomic-free kernel pair (bitwise reproducible), not the fused kernel
    deterministic: bool = False


def _rng_args(drop) -> tuple:
    """The kernels' dropout arguments (threshold, scale, seed lo/hi, offset lo/hi, seed tensor): all None
    without dropout (the p = 0 kernel takes none of them)."""
    if drop is None:
        return (None,) * 7
    v = drop.kernel_values()
    return (v["dropout_threshold"], v["dropout_scale"], v["rng_seed_lo"], v["rng_seed_hi"], v["rng_offset_lo"],
            v["rng_offset_hi"], v["rng_seed"])


@dataclass
class _Plan:
    """Memoised per configuration: the forward kernel config and launcher, the backward configs (validated at
    forward time when gradients are needed, so a training step never fails half-way)."""

    fwd_cfg: FwdKernelConfig
    fwd_fn: object = None
    bwd_cfg: object = None
    dq_cfg: object = None
    bwd_fn: object = None
    dq_fn: object = None


_PLANS: dict[tuple, _Plan] = {}


def _plan(dtype: str, d: int, dv: int, windowed: bool, softcap: bool, sink: bool, vq: bool, vk: bool, uq: bool,
          uk: bool, needs_grad: bool, device_index: int, paged: bool = False, split: bool = False,
          sparse: tuple = (0, 0), decode: int = 0, sparse_bwd: tuple = (0, 0, 0, 0), dropout: bool = False,
          seed_tensor: bool = False, dropout_packed: bool = False, dropout_high_p: bool = False, mods=None,
          paged_tma: bool = False, tma: bool = True) -> _Plan:
    """``split``: fp32 split-KV partials; ``sparse``: (q_ratio, kv_ratio, q_block, kv_block) of block sparsity,
    (0, 0) when off (it runs config.select_sparse_tile of the block size, the first tile when it is left out);
    ``decode``: a call with at most that many query rows per CTA (the tile_m of its decode tile; True: up to
    DECODE_MAX_ROWS), which runs config_decode.decode_tile of them, 0 otherwise;
    ``sparse_bwd``: the block ratios of the dQ kernel (forward lists) and of the dK/dV kernel (KV-major lists),
    (dq_q, dq_kv, dkdv_q, dkdv_kv), zeros when off; ``dropout``/``seed_tensor``/``dropout_packed``/``dropout_high_p``:
    Philox dropout, seed from a device tensor, packed GQA rows, p > 0.96875 (the forward's keep test; never with
    split, sparse or decode: the callers refuse or avoid those pairs); ``mods``: modspec.ModSpec or None (the
    forward kernel keys on its forward part; never with decode or sparse; with dropout, packed or not);
    ``paged_tma``: a paged prefill call whose pages hold whole K/V tiles of the TMA tile (``paged_eligible_for_tma``;
    ignored with split or decode, which keep the cp.async tiles); ``tma``: the device has TMA (device.DeviceCaps;
    without it every forward tile is a cp.async one).  Every argument after ``device_index`` is passed by keyword."""
    if paged and (vk or needs_grad or dropout or sparse[0]):
        # the call path refuses these first (_check_inputs, run_forward, block_sparse.refuse_combinations); the plan
        # refuses them too, so a walk over plans (the compile gate's class sweep) meets only what a call can run
        what = [n for n, on in (("cu_seqlens_k", vk), ("a backward", needs_grad), ("dropout", dropout),
                                ("block sparsity", sparse[0])) if on]
        raise ValueError(f"paged K/V (page_table) cannot be combined with {', '.join(what)} (inference-only, "
                         "lengths from seqused_k)")
    paged_tma = paged_tma and paged and tma and not (split or decode)
    key = (dtype, d, dv, windowed, softcap, sink, vq, vk, uq, uk, needs_grad, device_index, paged, split, sparse,
           decode, sparse_bwd, dropout, seed_tensor, dropout_packed, dropout_high_p, mods, paged_tma, tma,
           table_version())
    plan = _PLANS.get(key)
    if plan is None:
        tile = (select_sparse_tile(d, dv, windowed, mods is not None, block_size=tuple(sparse[2:4]) or None, tma=tma)
                if sparse[0] else select_fwd_tile(d, dv, windowed, paged, tma=tma))
        if paged_tma:  # the contiguous call's TMA tile (paged_eligible_for_tma checked its tile_n)
            tile = paged_tma_tile(d, dv, windowed, tma=tma) or tile
        if decode:
            tile = decode_tile(d, dv, DECODE_MAX_ROWS if decode is True else decode)
        elif split:
            tile = split_tile(tile)
        if dropout:  # the tile of the path without dropout, except where that one spills (config.py)
            tile = dropout_fwd_tile(d, dv, tile, tma)
        if mods is not None:
            tile = mods_dropout_fwd_tile(d, dv, tma) if dropout else mods_tile(tile, d, dv)
        plan = _Plan(FwdKernelConfig(dtype=dtype, head_dim=d, head_dim_v=dv, tile=tile, windowed=windowed,
                                     has_softcap=softcap, has_sink=sink, varlen_q=vq, varlen_k=vk, seqused_q=uq,
                                     seqused_k=uk, paged=paged, split_kv=split, sparse_q_ratio=sparse[0],
                                     sparse_kv_ratio=sparse[1], has_dropout=dropout,
                                     dropout_seed_tensor=seed_tensor, dropout_packed=dropout_packed,
                                     dropout_high_p=dropout_high_p, mods=None if mods is None else mods.forward_part()))
        if needs_grad:
            flags = dict(windowed=windowed, has_softcap=softcap, varlen_q=vq, varlen_k=vk, seqused_q=uq,
                         seqused_k=uk, has_dropout=dropout, dropout_seed_tensor=seed_tensor, mods=mods)
            plan.bwd_cfg = select_bwd_config(dtype, d, dv, **flags, sparse_q_ratio=sparse_bwd[2],
                                             sparse_kv_ratio=sparse_bwd[3])  # raises now, not mid-step
            plan.dq_cfg = select_dq_config(dtype, d, dv, **flags, sparse_q_ratio=sparse_bwd[0],
                                           sparse_kv_ratio=sparse_bwd[1], sink_grad=sink)
        _PLANS[key] = plan
    return plan


# cuTensorMapEncodeTiled's limits on a global tensor: base address 16-byte aligned, every stride but the innermost
# a multiple of 16 bytes below 2**40 bytes
_TMA_MAX_STRIDE_BYTES = 1 << 40


def tma_views_ok(*tensors) -> bool:
    """Whether a TMA descriptor can be built over each tensor (last dim contiguous; base and every other stride
    16-byte aligned, positive, below 2**40 bytes).  k and v views of one fused cache ((2, num_pages, ...) or
    (num_pages, 2, ...)) qualify when each view does; a stride of 0 (an expanded tensor) does not."""
    for t in tensors:
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        for st in t.stride()[:-1]:
            if st <= 0 or (st * es) % 16 or st * es >= _TMA_MAX_STRIDE_BYTES:
                return False
    return True


def paged_eligible_for_tma(k, v, d: int, dv: int, windowed: bool, mods=None, tma: bool = True) -> bool:
    """Whether a paged call (k/v (num_pages, page_size, Hkv, D|Dv)) runs the TMA kernel on its prefill tile: the
    contiguous call's tile is a TMA tile whose tile_n divides the page size (every K/V tile inside one page, one
    TMA box per tile), both views qualify for TMA (``tma_views_ok``), and the call has no score/mask mods (their
    paged TMA variants are not built by the compile gate).  Otherwise it runs the cp.async kernel, any page size.
    Split-KV and decode calls keep their cp.async tiles whatever this says (``_plan``).  ``tma``: the device has
    TMA (else False)."""
    if mods is not None or paged_tma_tile(d, dv, windowed, int(k.shape[1]), tma=tma) is None:
        return False
    return tma_views_ok(k, v)


def _nograd(t):
    return t.detach() if t.requires_grad else t


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- lengths ---------------------------------------------------------------------------------------------------
def _max_len(cu_seqlens, seqused, rows: int, name: str, max_seqlen) -> int:
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
    if _capturing():
        raise ValueError(f"max_seqlen_{name} is required when capturing a CUDA graph with varlen inputs")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).clamp_(min=0)
    if seqused is not None:
        lens = torch.minimum(lens, seqused.clamp(min=0))
    return min(int(lens.max().item()) if lens.numel() else 0, rows)  # the documented single read


def _debug_check_lengths(cu_seqlens, seqused, batch: int, static_len: int, total: int, name: str, max_seqlen):
    """Opt-in host checks of metadata values (one device->host copy); raises ValueError naming the lie."""
    if cu_seqlens is None and seqused is None:
        return
    if _capturing():
        raise ValueError("debug_checks read cu_seqlens/seqused on the host, which cannot be done while capturing a "
                         "CUDA graph; turn them off for the capture")
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


def _debug_check_pages(page_table, seqused_k, page_size: int, num_pages: int) -> None:
    """Opt-in host check of a page table (one device->host copy): every page a sequence uses (the first
    ceil(seqused_k / page_size) entries of its row; the rest may be padding such as -1) is in [0, num_pages)."""
    if _capturing():
        raise ValueError("debug_checks read page_table on the host, which cannot be done while capturing a CUDA "
                         "graph; turn them off for the capture")
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


def forward_meta(q, k, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_size, softcap, debug_checks=None, page_table=None) -> FwdMeta:
    """Host values of a call (scale, window, grid lengths), without reading device memory when the caller gave
    what FlashAttention asks for.  With ``page_table`` the k extent is max_pages_per_seq * page_size."""
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        rows_q = seqlen_q_static = q.shape[0]
    else:
        batch, seqlen_q_static = q.shape[0], q.shape[1]
        rows_q = seqlen_q_static
    rows_k = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    if page_table is not None:
        rows_k = page_table.shape[1] * k.shape[1]
    scale, softcap = V.check_scalars(softmax_scale, softcap, q.shape[-1])
    left, right = V.resolve_window(causal, window_size)
    if (cu_seqlens_q is not None or cu_seqlens_k is not None or seqused_q is not None or seqused_k is not None
            or page_table is not None) and debug_checks_enabled(debug_checks):
        _debug_check_lengths(cu_seqlens_q, seqused_q, batch, seqlen_q_static, q.shape[0], "q", max_seqlen_q)
        _debug_check_lengths(cu_seqlens_k, seqused_k, batch, rows_k, k.shape[0], "k", max_seqlen_k)
        if page_table is not None:
            _debug_check_pages(page_table, seqused_k, k.shape[1], k.shape[0])
    max_q = _max_len(cu_seqlens_q, seqused_q, rows_q, "q", max_seqlen_q)
    max_k = _max_len(cu_seqlens_k, seqused_k, rows_k, "k", max_seqlen_k)
    windowed = causal or left != V.WINDOW_UNBOUNDED or right != V.WINDOW_UNBOUNDED
    return FwdMeta(scale, softcap, left, right, windowed, batch, max_q, max_k)


def _choose_pack(pack_gqa, ratio: int, max_seqlen_q: int, tile_m: int) -> int:
    if pack_gqa is None:
        # Packing fills a query tile with the heads of one KV group when a sequence alone cannot.
        return ratio if ratio > 1 and max_seqlen_q * 2 <= tile_m else 1
    if not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
    return ratio if pack_gqa else 1


def _log2_scales(meta: FwdMeta) -> tuple[float, float]:
    """(scale_log2, softcap_prescale) of the score hook.  With a score_mod: (log2(e), softmax scale), the mod
    seeing the scaled scores (upstream's convention)."""
    if meta.mods is not None and meta.mods.score_mod is not None:
        return _LOG2_E, meta.scale
    if meta.softcap > 0:
        return meta.softcap * _LOG2_E, meta.scale / meta.softcap
    return meta.scale * _LOG2_E, 1.0


def _sparse_bwd_key(meta: FwdMeta) -> tuple:
    """The backward's block-sparse plan key (the dQ and dK/dV ratios; zeros without block sparsity)."""
    sg = meta.sparse
    return (0, 0, 0, 0) if sg is None else (*sg.dq_ratios, *sg.dkdv_ratios)


# ---- forward ---------------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table=None):
    """Rank/dtype/device/stride/shape checks of one call (raise before any launch); returns batch."""
    if page_table is not None and cu_seqlens_k is not None:
        raise ValueError("page_table cannot be combined with cu_seqlens_k: with paged K/V the lengths come from "
                         "seqused_k (leave cu_seqlens_k=None)")
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    V.check_tensor("q", q, 3 if varlen_q else 4)
    dev = q.device
    V.check_tensor("k", k, 3 if varlen_k else 4, dev)
    V.check_tensor("v", v, 3 if varlen_k else 4, dev)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    d, dv = q.shape[-1], v.shape[-1]
    V.check_head_dims(d, dv)
    if k.shape[-1] != d:
        raise ValueError(f"k.shape[-1]={k.shape[-1]} must equal q.shape[-1]={d}")
    V.check_heads(q.shape[-2], k.shape[-2], v.shape[-2])
    if varlen_q:
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
            raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of shape (batch + 1,), got "
                             f"{type(cu_seqlens_q).__name__} {tuple(getattr(cu_seqlens_q, 'shape', ()))}")
        batch = cu_seqlens_q.shape[0] - 1
        if batch < 0:
            raise ValueError("cu_seqlens_q must have shape (batch + 1,) with batch >= 0, got shape (0,)")
    else:
        batch = q.shape[0]
    if page_table is not None:
        V.check_page_table(page_table, k, v, batch, dev, cu_seqlens_k)
    elif varlen_k:
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    elif k.shape[:2] != v.shape[:2] or k.shape[0] != batch:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have batch {batch} and equal sequence lengths"
        )
    if varlen_q:
        V.check_index_tensor("cu_seqlens_q", cu_seqlens_q, batch + 1, dev)
    if varlen_k:
        V.check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, dev)
    if seqused_q is not None:
        V.check_index_tensor("seqused_q", seqused_q, batch, dev)
    if seqused_k is not None:
        V.check_index_tensor("seqused_k", seqused_k, batch, dev)
    V.check_batch(batch)
    V.check_lengths(seqlen_q=q.shape[0] if varlen_q else q.shape[1], seqlen_k=k.shape[0] if varlen_k else k.shape[1])
    return batch


def run_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                learnable_sink=None, softcap=0.0, pack_gqa=None, needs_grad=False, debug_checks=None,
                page_table=None, num_splits=1, block_sparse_tensors=None, block_sparse_tensors_bwd=None,
                dropout_p=0.0, dropout_seed=None, dropout_offset=None, mods=None, aux_tensors=(),
                deterministic=False):
    """Validate, then run the forward kernel.  Returns (out, lse, meta, sink_fp32).  With ``needs_grad`` the
    backward configuration is validated too, before anything launches.  ``page_table``: paged K/V (inference
    only: with ``needs_grad`` or dropout it raises).  ``num_splits``: split-KV (splitkv.py; 1 = none, <= 0 =
    automatic).  ``block_sparse_tensors``: see block_sparse.py (one split); with ``needs_grad`` the block sizes for
    the backward and ``block_sparse_tensors_bwd`` (the KV-major lists, optional) are checked here and kept in the
    meta.  ``mods``/``aux_tensors``: the checked modspec.ModSpec and aux tuple of a call with score/mask mods
    (modspec.check_mods).

    Dropout (dropout.py states the RNG contract): 0 < p < 1 runs the kernels compiled with dropout; p = 0 the
    kernels without it; p = 1 the kernels without it, then O = 0 (the LSE is that of the undropped scores, and
    the backward gives only the LSE's gradient).  Dropout with split-KV (num_splits != 1) or block sparsity raises
    ValueError; with score/mask mods the mods act on the scores, dropout on P after the softmax."""
    p_drop = D.check_p(dropout_p)
    num_splits = SK.check_num_splits(num_splits)
    sparse = block_sparse_tensors is not None
    D.refuse_combinations(dropout_p, p_drop, num_splits, sparse)
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    caps = device_caps(q.device)  # UnsupportedDeviceError (naming the device) before anything compiles
    if page_table is not None and needs_grad:
        raise ValueError(PAGED_GRAD_ERROR)
    if page_table is not None and p_drop > 0.0:
        raise ValueError(PAGED_DROPOUT_ERROR.format(p=dropout_p))

    if sparse:
        BS.refuse_combinations(page_table, pack_gqa)
    varlen_q = cu_seqlens_q is not None
    dev = q.device
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv = k.shape[-2], v.shape[-1]
    sink = V.check_sink(learnable_sink, hq, dev)
    meta = forward_meta(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                        debug_checks=debug_checks, page_table=page_table)
    if deterministic:
        meta = replace(meta, deterministic=True)
    drop = None
    if p_drop > 0.0:
        drop = D.resolve(p_drop, dropout_seed, dropout_offset, dev, _capturing())
        meta = replace(meta, dropout=drop)
    elif dropout_seed is not None or dropout_offset is not None:
        D.check_seed(dropout_seed, dropout_offset, dev)  # a wrong type raises even when p = 0
    in_kernel = drop is not None and drop.p < 1.0
    if in_kernel and mods is not None:
        mods_dropout_fwd_tile(d, dv, caps.tma)  # ValueError (naming both, and the head dims) where no tile carries both
    if mods is not None:
        meta = replace(meta, mods=mods)
    ratios, sparse_args = (0, 0), (None, None, None, None)
    if sparse:
        ratios, sparse_args = BS.check_block_sparse(
            block_sparse_tensors, batch=meta.batch, heads=hq, max_q=meta.max_q, max_k=meta.max_k, head_dim=d,
            head_dim_v=dv, windowed=meta.windowed, device=dev, debug=debug_checks_enabled(debug_checks), tma=caps.tma)
        # the plan key carries the block size: it picks the tile (config.select_sparse_tile)
        ratios = (*ratios, *(getattr(block_sparse_tensors, "block_size", None) or BS.DEFAULT_BLOCK_SIZE))
        if needs_grad:
            meta = replace(meta, sparse=BS.prepare_backward(
                block_sparse_tensors, block_sparse_tensors_bwd, sparse_args, batch=meta.batch, heads=hq,
                max_q=meta.max_q, max_k=meta.max_k, head_dim=d, head_dim_v=dv, windowed=meta.windowed, device=dev,
                debug=debug_checks_enabled(debug_checks), mods=mods))
    plan = _plan(V.DTYPE_NAMES[q.dtype], d, dv, meta.windowed, meta.softcap > 0, sink is not None, varlen_q,
                 cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None, needs_grad, dev.index,
                 paged=page_table is not None, sparse=ratios, sparse_bwd=_sparse_bwd_key(meta), dropout=in_kernel,
                 seed_tensor=in_kernel and drop.seed_tensor is not None,
                 dropout_high_p=in_kernel and drop.high_p, mods=mods,
                 paged_tma=page_table is not None and paged_eligible_for_tma(k, v, d, dv, meta.windowed, mods, caps.tma),
                 tma=caps.tma)
    out = q.new_empty((*q.shape[:-1], dv))
    lse = torch.empty((hq, q.shape[0]) if varlen_q else (meta.batch, hq, q.shape[1]), dtype=torch.float32,
                      device=dev)
    if out.numel() == 0:
        return out, lse, meta, sink
    if meta.max_q == 0 or meta.max_k == 0:  # nothing to attend to anywhere: O = 0, LSE = -inf (or the sink logit)
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink[:, None].expand_as(lse) if varlen_q else sink[None, :, None].expand_as(lse))
        return out, lse, meta, sink
    tile_m = plan.fwd_cfg.tile.tile_m
    ratio = hq // hkv
    pack = 1 if sparse else _choose_pack(pack_gqa, ratio, meta.max_q, tile_m)
    if in_kernel and pack > 1 and plan.fwd_cfg.tile.tile_n > 64:
        # known issue (H100, 2026-11-22): the packed-row keep bits on the 128-key tiles (d <= 64 with causal or
        # a window) gave wrong outputs; those calls run unpacked (same result, one head per tile row block)
        pack = 1
    if in_kernel and pack > 1:  # packed rows make the keep bits row by row (config.FwdKernelConfig.dropout_packed)
        plan = _plan(V.DTYPE_NAMES[q.dtype], d, dv, meta.windowed, meta.softcap > 0, sink is not None, varlen_q,
                     cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None, needs_grad, dev.index,
                     paged=page_table is not None, sparse=ratios, dropout=True,
                     seed_tensor=drop.seed_tensor is not None, dropout_packed=True, dropout_high_p=drop.high_p,
                     mods=mods, tma=caps.tma)
    scale_log2, prescale = _log2_scales(meta)
    # decode (few query rows per CTA: q_len x the packed GQA group <= DECODE_MAX_ROWS) runs the decode tile, split
    # or not (H100, B=64 KV 2K d128: 210 us on the 128-row TMA tile, 183 us on it; paged 267 -> 191 us)
    # (not with in-kernel dropout: its tiles are gated on the prefill tiles)
    # (not with mods either: the d256 decode tile is not among the tiles gated with mods, config.MODS_TILE_FALLBACK)
    # (the fewer rows, the more warp groups split each K/V tile's keys: config_decode.py, kernels/fwd_decode.py)
    decode = 0
    if not sparse and not in_kernel and mods is None and meta.max_q * pack <= DECODE_MAX_ROWS:
        dtile = decode_tile(d, dv, meta.max_q * pack)
        if dtile is not None and dtile.kv_groups > 1:  # a key split, unless the grid fills the GPU without it
            grid = meta.batch * (hq // pack) * max(num_splits, 1)  # one 64-row tile per (batch, head group)
            dtile = decode_tile(d, dv, decode_rows(meta.max_q * pack, grid, sm_count(dev)))
        decode = 0 if dtile is None else dtile.tile_m  # the plan key: the row bucket, not the row count
    plan_args = (V.DTYPE_NAMES[q.dtype], d, dv, meta.windowed, meta.softcap > 0, sink is not None, varlen_q,
                 cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None)
    if decode:
        plan = _plan(*plan_args, needs_grad, dev.index, paged=page_table is not None, decode=decode, tma=caps.tma)
    num_m_blocks = -(-meta.max_q * pack // plan.fwd_cfg.tile.tile_m)
    splits = SK.resolve_num_splits(num_splits, needs_grad=needs_grad, batch=meta.batch,
                                   ctas=num_m_blocks * (hq // pack) * meta.batch,
                                   n_blocks=-(-meta.max_k // plan.fwd_cfg.tile.tile_n), dv=dv, device=dev,
                                   paged=page_table is not None, caps=caps)
    o_dst, lse_dst = out, lse
    if splits > 1:  # fp32 partials with a leading split dim, combined below
        plan = _plan(*plan_args, False, dev.index, paged=page_table is not None, split=True, decode=decode,
                     mods=mods, tma=caps.tma)
        num_m_blocks = -(-meta.max_q * pack // plan.fwd_cfg.tile.tile_m)
        o_dst, lse_dst = SK.partials(out, lse, splits)
    if plan.fwd_fn is None:
        plan.fwd_fn = _kernel(plan.fwd_cfg, dev)
    thr, dscale, seed_lo, seed_hi, off_lo, off_hi, seed_t = _rng_args(drop if in_kernel else None)
    _launch(plan.fwd_fn, FWD_ARGS, dev, dict(
        q=_nograd(q), k=_nograd(k), v=_nograd(v), out=o_dst, lse=lse_dst, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, sink=sink,
        mask_block_cnt=sparse_args[0], mask_block_idx=sparse_args[1], full_block_cnt=sparse_args[2],
        full_block_idx=sparse_args[3], aux_tensors=aux_tensors or None, scale_log2=scale_log2,
        softcap_prescale=prescale, window_left=meta.left, window_right=meta.right, pack=pack,
        qheads_per_kvhead=ratio, num_m_blocks=num_m_blocks, num_head_groups=hq // pack,
        num_batch=meta.batch * splits, dropout_threshold=thr, dropout_scale=dscale, rng_seed_lo=seed_lo,
        rng_seed_hi=seed_hi, rng_offset_lo=off_lo, rng_offset_hi=off_hi, rng_seed=seed_t,
    ))
    if splits > 1:
        SK.combine_into(o_dst, lse_dst, out, lse, varlen_q)
    if drop is not None and not in_kernel:  # p = 1: every probability dropped
        out.zero_()
    return out, lse, meta, sink


__all__ = ["FwdMeta", "forward_meta", "run_forward", "debug_checks_enabled", "MAX_SEQLEN"]
