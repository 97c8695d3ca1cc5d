"""Public API, keyword-compatible with upstream flash-attn-4 (``flash_attn.cute``) 4.0.0b36.

Every entry point follows the same path: normalise -> validate (raises before any launch) -> select the kernel
configuration -> get the compiled kernel (memory/disk cache) -> launch.  Arguments after ``v`` are keyword-only,
so a positional call written for another signature fails loudly instead of binding the wrong parameter.
"""

from __future__ import annotations

import torch

from . import ops
from .autograd import FlashAttnFunction
from .dispatch import run_forward
from .dropout import check_p
from .features import require


def _unsupported(**values) -> None:
    for name, value in values.items():
        if value is not None:
            raise NotImplementedError(
                f"{name} is not supported by flash-attn-4-sm120 (got a non-default value); leave it at None"
            )


def _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic) -> None:
    p = check_p(dropout_p)  # ValueError for a non-number, NaN or a value outside [0, 1]
    if num_splits != 1:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool):
            raise ValueError(f"num_splits must be an int, got {num_splits!r}")
        if num_splits > 1 and p > 0:
            raise ValueError(f"dropout_p={dropout_p} with num_splits={num_splits}: dropout is not supported with "
                             "split-KV; use num_splits=1")
        if num_splits > 1:
            require("split_kv", f"num_splits={num_splits}")
    if block_sparse_tensors is not None:
        if p > 0:
            raise ValueError(f"dropout_p={dropout_p} with block_sparse_tensors: dropout is not supported with block "
                             "sparsity")
        require("block_sparse", "block_sparse_tensors")
    if p > 0:
        require("dropout", f"dropout_p={dropout_p}")
    # deterministic: accepted for compatibility; the backward is always deterministic (no atomics)


def _attention(q, k, v, learnable_sink, return_lse, kw):
    """Forward, through autograd when any input requires grad, through the torch.library op when compiling."""
    if torch.compiler.is_compiling():  # one opaque op (with autograd) for torch.compile
        window = kw["window_size"]
        left, right = (None, None) if window is None else window
        seed = kw["dropout_seed"]
        seed_tensor = seed if isinstance(seed, torch.Tensor) else None
        seed_int = None if seed is None or seed_tensor is not None else ops.signed64("dropout_seed", seed)
        offset = None if kw["dropout_offset"] is None else ops.signed64("dropout_offset", kw["dropout_offset"])
        out, lse, _ = ops.fwd(
            q, k, v, learnable_sink, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"], kw["seqused_k"],
            kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"], left, right,
            float(kw["softcap"] or 0.0), kw["pack_gqa"], kw["debug_checks"], float(kw["dropout_p"]), seed_int,
            seed_tensor, offset,
        )
    elif torch.is_grad_enabled() and (  # getattr: a non-tensor argument reaches validation's clear error
            getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
            or getattr(v, "requires_grad", False) or getattr(learnable_sink, "requires_grad", False)):
        out, lse = FlashAttnFunction.apply(q, k, v, learnable_sink, kw)
    else:
        out, lse, _, _ = run_forward(q, k, v, learnable_sink=learnable_sink, **kw)
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
    dropout_seed: int | torch.Tensor | None = None,
    dropout_offset: int | None = None,
):
    """Attention over (B, S, H, D) tensors.  Returns ``(out, lse)``: out (B, Sq, Hq, Dv) in q's dtype, lse fp32
    (B, Hq, Sq) natural-log softmax normaliser when ``return_lse=True``, else None.

    GQA/MQA: k/v may have fewer heads (Hq a multiple of Hkv); they are never copied.  ``causal`` is bottom-right
    aligned when Sq != Sk.  ``window_size=(left, right)``: None (or negative) is unbounded.  ``softcap > 0``
    applies ``softcap * tanh(s / softcap)`` to the scaled scores.  ``learnable_sink`` (Hq,) adds one logit per
    head to the softmax denominator.  ``pack_gqa`` packs the query heads of a KV group into one tile (None:
    automatic).  ``deterministic`` concerns the backward only (the forward is always deterministic).

    ``dropout_p`` in [0, 1]: attention dropout (Philox4x32-7; the keep mask is a function of (seed, offset,
    batch, head, query, key) only, see ``dropout.py`` and ``dropout_mask``).  Without ``dropout_seed`` the seed
    and offset come from torch's CUDA generator (``torch.manual_seed`` reproduces a call; each call advances
    the offset).  ``dropout_seed``: an int, or a CUDA int64 tensor of one value (required under CUDA-graph
    capture; change it between replays); ``dropout_offset``: an int (default 0 with a seed).  Dropout with
    num_splits > 1 or block sparsity raises.
    """
    _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic)
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors is not None or aux_scalars is not None
            or block_sparse_tensors_bwd is not None):
        _unsupported(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                     mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
                     block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    return _attention(q, k, v, learnable_sink, return_lse, dict(
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, pack_gqa=pack_gqa,
        debug_checks=None, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    ))


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
    debug_checks: bool | None = None,
    dropout_seed: int | torch.Tensor | None = None,
    dropout_offset: int | None = None,
):
    """Variable-length attention.  With ``cu_seqlens_q`` (B+1,) int32, q is (total_q, Hq, D) and out/lse are
    (total_q, Hq, Dv) / (Hq, total_q); without it q is (B, Sq, Hq, D).  Likewise ``cu_seqlens_k`` for k/v.
    ``seqused_q/k`` (B,) int32 cap the length of each sequence; zero-length sequences are allowed and give
    O = 0, LSE = -inf.

    No device->host sync when ``max_seqlen_q/k`` are given (they are trusted, as in FlashAttention); a missing one
    is computed on the device and read once.  The values of ``cu_seqlens``/``seqused`` are the caller's contract:
    they are not read on the host, and a lie gives wrong numbers but never an out-of-bounds access.
    ``debug_checks=True`` (or FA4_SM120_DEBUG_CHECKS=1) checks them on the host and raises ValueError naming the
    lie.  Other arguments (dropout included; positions are counted within each sequence, and the mask's batch
    index is the sequence's index) as in ``flash_attn_func``.
    """
    if page_table is not None:
        require("paged_kv", "page_table")
    _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic)
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors is not None or aux_scalars is not None
            or min_seqlen_k is not None or scheduler_metadata is not None or seqlen_k_per_split is not None):
        _unsupported(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                     mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, min_seqlen_k=min_seqlen_k,
                     scheduler_metadata=scheduler_metadata, seqlen_k_per_split=seqlen_k_per_split)
    return _attention(q, k, v, learnable_sink, return_lse, dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, pack_gqa=pack_gqa, debug_checks=debug_checks,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    ))
