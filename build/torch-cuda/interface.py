"""Public API, keyword-compatible with upstream flash-attn-4 (``flash_attn.cute``) 4.0.0b36.

Every entry point follows the same path: normalise -> validate (raises before any launch) -> select the kernel
configuration -> get the compiled kernel (memory/disk cache) -> launch.  Arguments after ``v`` are keyword-only,
so a positional call written for another signature fails loudly instead of binding the wrong parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import ops
from . import validate as V
from .config import FwdKernelConfig, select_bwd_config, select_fwd_tile
from .features import require


def _unsupported(name: str, value, default=None) -> None:
    if value is not default:
        raise NotImplementedError(
            f"{name} is not supported by flash-attn-4-sm120 (got a non-default value); leave it at {default!r}"
        )


def _check_common_unsupported(num_splits, block_sparse_tensors, dropout_p, extra: dict) -> None:
    for name, value in extra.items():
        _unsupported(name, value)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool):
        raise ValueError(f"num_splits must be an int, got {num_splits!r}")
    if num_splits > 1:
        require("split_kv", f"num_splits={num_splits}")
    if block_sparse_tensors is not None:
        require("block_sparse", "block_sparse_tensors")
    if dropout_p:
        require("dropout", f"dropout_p={dropout_p}")


def _choose_pack(pack_gqa, ratio: int, max_seqlen_q: int, tile_m: int) -> int:
    if pack_gqa is None:
        # Packing fills a query tile with the heads of one KV group when a sequence alone cannot.
        return ratio if ratio > 1 and max_seqlen_q * 2 <= tile_m else 1
    if not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")
    return ratio if pack_gqa else 1


def _host_lengths(cu_seqlens, seqused, batch: int, static_len: int, total: int, name: str, max_seqlen):
    """Per-batch lengths checked on the host (one small device->host copy); returns the max length.

    Under CUDA-graph capture the values cannot be read: then ``max_seqlen`` must be given and is trusted.
    """
    if cu_seqlens is None and seqused is None:
        return static_len
    if torch.cuda.is_current_stream_capturing():
        if max_seqlen is None:
            raise ValueError(f"max_seqlen_{name} is required when capturing a CUDA graph with varlen inputs")
        return int(max_seqlen)
    parts = [t for t in (cu_seqlens, seqused) if t is not None]
    vals = torch.cat(parts).tolist()
    if cu_seqlens is not None:
        cu, vals = vals[: batch + 1], vals[batch + 1 :]
        if cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(
                f"cu_seqlens_{name} must be non-decreasing, start >= 0 and end <= {total} (the total number of "
                f"tokens of {name}); got {cu[:8]}{'...' if len(cu) > 8 else ''}"
            )
        lens = [b - a for a, b in zip(cu, cu[1:])]
    else:
        lens = [static_len] * batch
    if seqused is not None:
        used = vals[:batch]
        bad = [(i, u, n) for i, (u, n) in enumerate(zip(used, lens)) if not 0 <= u <= n]
        if bad:
            i, u, n = bad[0]
            raise ValueError(f"seqused_{name}[{i}]={u} must be in [0, {n}] (the length of that sequence)")
        lens = used
    longest = max(lens, default=0)
    if max_seqlen is not None and int(max_seqlen) < longest:
        raise ValueError(f"max_seqlen_{name}={max_seqlen} is smaller than the longest sequence ({longest})")
    return longest


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


def forward_meta(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_size, softcap) -> FwdMeta:
    """Host values of a call (scale, window, longest sequences); reads cu_seqlens/seqused once when given."""
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        total_q = seqlen_q_static = q.shape[0]
    else:
        batch, seqlen_q_static = q.shape[0], q.shape[1]
        total_q = batch * seqlen_q_static
    seqlen_k_static = k.shape[0] if cu_seqlens_k is not None else k.shape[1]
    scale, softcap = V.check_scalars(softmax_scale, softcap, q.shape[-1])
    left, right = V.resolve_window(causal, window_size)
    max_q = _host_lengths(cu_seqlens_q, seqused_q, batch, seqlen_q_static, total_q, "q", max_seqlen_q)
    max_k = _host_lengths(cu_seqlens_k, seqused_k, batch, seqlen_k_static, k.shape[0], "k", max_seqlen_k)
    V.check_lengths(max_seqlen_q=max_q, max_seqlen_k=max_k)
    windowed = causal or left != V.WINDOW_UNBOUNDED or right != V.WINDOW_UNBOUNDED
    return FwdMeta(scale, softcap, left, right, windowed, batch, max_q, max_k)


def _forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal, window_size, learnable_sink, softcap, pack_gqa, needs_grad=False):
    """Validate, then run the forward kernel.  Returns (out, lse, meta, sink_fp32).  With ``needs_grad`` the
    backward configuration is validated too, before anything launches."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    V.check_tensor("q", q, 3 if varlen_q else 4)
    dev = q.device
    V.check_tensor("k", k, 3 if varlen_k else 4, dev)
    V.check_tensor("v", v, 3 if varlen_k else 4, dev)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    hq, d = q.shape[-2:]
    hkv, dv = k.shape[-2], v.shape[-1]
    V.check_head_dims(d, dv)
    if k.shape[-1] != d:
        raise ValueError(f"k.shape[-1]={k.shape[-1]} must equal q.shape[-1]={d}")
    V.check_heads(hq, hkv, v.shape[-2])
    if varlen_q:
        batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else -1
        total_q, seqlen_q_static = q.shape[0], q.shape[0]
    else:
        batch, seqlen_q_static = q.shape[0], q.shape[1]
        total_q = batch * seqlen_q_static
    if varlen_k:
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
        seqlen_k_static = k.shape[0]
    else:
        if k.shape[:2] != v.shape[:2] or k.shape[0] != batch:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must have batch {batch} and equal sequence lengths"
            )
        seqlen_k_static = k.shape[1]
    if batch < 0:
        raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of shape (batch + 1,)")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            V.check_index_tensor(name, t, batch + 1, dev)
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            V.check_index_tensor(name, t, batch, dev)
    V.check_batch(batch)
    V.check_lengths(seqlen_q=seqlen_q_static, seqlen_k=seqlen_k_static)
    sink = V.check_sink(learnable_sink, hq, dev)
    meta = forward_meta(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    scale, softcap, left, right, windowed = meta.scale, meta.softcap, meta.left, meta.right, meta.windowed
    max_q, max_k = meta.max_q, meta.max_k
    if needs_grad:
        select_bwd_config(V._DTYPES[q.dtype], d, dv, windowed=windowed)  # raises now, not mid-step
    out_shape = (*q.shape[:-1], dv)
    out = torch.empty(out_shape, dtype=q.dtype, device=dev)
    lse = torch.empty((hq, total_q) if varlen_q else (batch, hq, seqlen_q_static), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse, meta, sink
    tile = select_fwd_tile(d, dv, windowed)
    cfg = FwdKernelConfig(
        dtype=V._DTYPES[q.dtype], head_dim=d, head_dim_v=dv, tile=tile, windowed=windowed,
        has_softcap=softcap > 0, has_sink=sink is not None, varlen_q=varlen_q, varlen_k=varlen_k,
        seqused_q=seqused_q is not None, seqused_k=seqused_k is not None,
    )
    if max_q == 0 or max_k == 0:  # nothing to attend to anywhere: O = 0, LSE = -inf (or the sink logit)
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink[:, None].expand_as(lse) if varlen_q else sink[None, :, None].expand_as(lse))
        return out, lse, meta, sink
    ratio = hq // hkv
    pack = _choose_pack(pack_gqa, ratio, max_q, tile.tile_m)
    if softcap > 0:
        scale_log2, prescale = softcap * math.log2(math.e), scale / softcap
    else:
        scale_log2, prescale = scale * math.log2(math.e), 1.0
    num_m_blocks = -(-max_q * pack // tile.tile_m)

    from .jit import get_fwd_kernel  # CuTe-DSL loads on the first call, not at import

    kernel = get_fwd_kernel(cfg)
    with torch.cuda.device(dev):
        kernel(
            q.detach(), k.detach(), v.detach(), out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink,
            scale_log2, prescale, left, right, pack, ratio, num_m_blocks, hq // pack, batch,
        )
    return out, lse, meta, sink


def _attention(q, k, v, *, learnable_sink, deterministic, return_lse, **kw):
    """Forward, through autograd when any input requires grad."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, learnable_sink)
    )
    if torch.compiler.is_compiling():  # one opaque op (with autograd) for torch.compile
        left, right = (None, None) if kw["window_size"] is None else kw["window_size"]
        out, lse = ops.fwd(
            q, k, v, learnable_sink, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"], kw["seqused_k"],
            kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"], left, right,
            float(kw["softcap"] or 0.0), kw["pack_gqa"], bool(deterministic),
        )
    elif needs_grad:
        from .autograd import FlashAttnFunction

        out, lse = FlashAttnFunction.apply(q, k, v, learnable_sink, kw, bool(deterministic))
    else:
        out, lse, _, _ = _forward(q, k, v, learnable_sink=learnable_sink, **kw)
    return out, (lse if return_lse else None)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    block_sparse_tensors=None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    qv=None,
    gather_kv_indices=None,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors_bwd=None,
):
    """Attention over (B, S, H, D) tensors.  Returns ``(out, lse)``: out (B, Sq, Hq, Dv) in q's dtype, lse fp32
    (B, Hq, Sq) natural-log softmax normaliser when ``return_lse=True``, else None.

    GQA/MQA: k/v may have fewer heads (Hq a multiple of Hkv); they are never copied.  ``causal`` is bottom-right
    aligned when Sq != Sk.  ``window_size=(left, right)``: None (or negative) is unbounded.  ``softcap > 0``
    applies ``softcap * tanh(s / softcap)`` to the scaled scores.  ``learnable_sink`` (Hq,) adds one logit per
    head to the softmax denominator.  ``pack_gqa`` packs the query heads of a KV group into one tile (None:
    automatic).  ``deterministic`` concerns the backward only (the forward is always deterministic).
    """
    _check_common_unsupported(
        num_splits, block_sparse_tensors, dropout_p,
        dict(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
             mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
             block_sparse_tensors_bwd=block_sparse_tensors_bwd),
    )
    return _attention(
        q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
        max_seqlen_k=None, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        learnable_sink=learnable_sink, softcap=softcap, pack_gqa=pack_gqa, deterministic=deterministic,
        return_lse=return_lse,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    block_sparse_tensors=None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    min_seqlen_k: int | None = None,
    qv=None,
    gather_kv_indices=None,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
):
    """Variable-length attention.  With ``cu_seqlens_q`` (B+1,) int32, q is (total_q, Hq, D) and out/lse are
    (total_q, Hq, Dv) / (Hq, total_q); without it q is (B, Sq, Hq, D).  Likewise ``cu_seqlens_k`` for k/v.
    ``seqused_q/k`` (B,) int32 cap the length of each sequence; zero-length sequences are allowed and give
    O = 0, LSE = -inf.  ``max_seqlen_q/k`` are checked against the real maxima (or trusted under CUDA-graph
    capture).  Other arguments as in ``flash_attn_func``.
    """
    if page_table is not None:
        require("paged_kv", "page_table")
    _check_common_unsupported(
        num_splits, block_sparse_tensors, dropout_p,
        dict(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
             mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, min_seqlen_k=min_seqlen_k,
             scheduler_metadata=scheduler_metadata, seqlen_k_per_split=seqlen_k_per_split),
    )
    return _attention(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, learnable_sink=learnable_sink, softcap=softcap, pack_gqa=pack_gqa,
        deterministic=deterministic, return_lse=return_lse,
    )
