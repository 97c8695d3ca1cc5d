"""Public API, keyword-compatible with upstream flash-attn-4 (``flash_attn.cute``) 4.0.0b36.

Every entry point follows the same path: normalise -> check the feature combinations once (compat.py: the one
table of refusals) -> validate the tensors -> plan (the kernel configuration) -> get the compiled kernel
(memory/disk cache) -> launch; everything raises before any launch.  Arguments after ``v`` are keyword-only,
so a positional call written for another signature fails loudly instead of binding the wrong parameter.
"""

from __future__ import annotations

import torch

from . import compat
from . import ops
from .autograd import FlashAttnFunction
from . import validate as V
from .combine import run_combine
from .dispatch_fp8 import FP8_ANY, fp8_attention, fp8_unsupported, is_fp8
from .dispatch import run_forward
from .dropout import check_p
from .modspec import check_mods
from . import splitkv as SK
from .splitkv import check_num_splits
from .features import require


def _unsupported(**values) -> None:
    for name, value in values.items():
        if value is not None:
            raise NotImplementedError(
                f"{name} is not supported by flash-attn-4-sm120 (got a non-default value); leave it at None"
            )


def _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic, block_sparse_tensors_bwd=None) -> float:
    """The values of the arguments every entry point takes (their combinations: compat.check_call); returns the
    checked dropout probability."""
    p = check_p(dropout_p)  # ValueError for a non-number, NaN or a value outside [0, 1]
    num_splits = check_num_splits(num_splits)  # 1.0 or True are not ints here
    if num_splits != 1:
        require("split_kv", f"num_splits={num_splits}")
    if block_sparse_tensors is not None:
        require("block_sparse", "block_sparse_tensors")
    if block_sparse_tensors_bwd is not None:
        require("block_sparse_backward", "block_sparse_tensors_bwd")
    if p > 0:
        require("dropout", f"dropout_p={dropout_p}")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
    return p


def _needs_grad(*tensors) -> bool:
    # getattr: a non-tensor argument reaches validation's clear error
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _attention(q, k, v, learnable_sink, return_lse, kw, p=0.0):
    """Forward, through autograd when any input requires grad, through the torch.library op when compiling.
    ``p``: the checked dropout probability."""
    # _needs_grad inline (every call asks): getattr, so a non-tensor argument reaches validation's clear error
    needs_grad = torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
                                              or getattr(v, "requires_grad", False)
                                              or getattr(learnable_sink, "requires_grad", False))
    sparse = kw.get("block_sparse_tensors") is not None
    compiling = torch.compiler.is_compiling()
    if kw["num_splits"] is None:  # the default: automatic for an inference call (splitkv.default_for_call)
        kw["num_splits"] = SK.default_for_call(q, k, kw, p, needs_grad, sparse, compiling)
    mod_args = kw.pop("mod_args", None) or {}
    score_mod, mask_mod = mod_args.get("score_mod"), mod_args.get("mask_mod")
    compat.check_call(  # every refused combination, once per call
        p=p, dropout_p=kw.get("dropout_p", 0.0), num_splits=kw["num_splits"], sparse=sparse,
        sparse_bwd=kw.get("block_sparse_tensors_bwd") is not None, paged=kw.get("page_table") is not None,
        cu_seqlens_k=kw.get("cu_seqlens_k") is not None, pack_gqa=kw["pack_gqa"], needs_grad=needs_grad,
        compiling=compiling, mods=score_mod is not None or mask_mod is not None,
        score_mod=score_mod is not None, softcap=kw["softcap"], q=q, v=v)
    if score_mod is not None or mask_mod is not None or mod_args.get("score_mod_bwd") is not None \
            or mod_args.get("aux_tensors") is not None:
        mods, aux = check_mods(score_mod=score_mod, score_mod_bwd=mod_args.get("score_mod_bwd"), mask_mod=mask_mod,
                               aux_tensors=mod_args.get("aux_tensors"), device=getattr(q, "device", None),
                               needs_grad=needs_grad)
        if mods is not None:
            kw.update(mods=mods, aux_tensors=aux)
    if needs_grad:
        kw["num_splits"] = 1  # automatic (<= 0) means no split for a training call
    if sparse:  # eager only, one split (for now)
        kw["num_splits"] = 1  # automatic (<= 0) means one split for a block-sparse call
        if needs_grad:
            require("block_sparse_backward", "block_sparse_tensors with inputs that require grad")
            out, lse = FlashAttnFunction.apply(q, k, v, learnable_sink, kw)
        else:
            out, lse, _, _ = run_forward(q, k, v, learnable_sink=learnable_sink, **kw)
        return out, (lse if return_lse else None)
    if compiling:  # one opaque op (with autograd) for torch.compile
        window = kw["window_size"]
        left, right = (None, None) if window is None else window
        seed = kw.get("dropout_seed")
        seed_tensor = seed if isinstance(seed, torch.Tensor) else None
        seed_int = None if seed is None or seed_tensor is not None else ops.signed64("dropout_seed", seed)
        offset = kw.get("dropout_offset")
        offset = None if offset is None else ops.signed64("dropout_offset", offset)
        out, lse, _ = ops.fwd(
            q, k, v, learnable_sink, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"], kw["seqused_k"],
            kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"], left, right,
            float(kw["softcap"] or 0.0), kw["pack_gqa"], kw["debug_checks"], kw.get("page_table"),
            float(kw.get("dropout_p", 0.0)), seed_int, seed_tensor, offset, bool(kw.get("deterministic")),
        )
    elif needs_grad:
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
    num_splits: int | None = None,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    block_sparse_tensors=None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    page_table: torch.Tensor | None = None,
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
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention over (B, S, H, D) tensors.  Returns ``(out, lse)``: out (B, Sq, Hq, Dv) in q's dtype, lse fp32
    (B, Hq, Sq) natural-log softmax normaliser when ``return_lse=True``, else None.

    GQA/MQA: k/v may have fewer heads (Hq a multiple of Hkv); they are never copied.  ``causal`` is bottom-right
    aligned when Sq != Sk.  ``window_size=(left, right)``: None (or negative) is unbounded.  ``softcap > 0``
    applies ``softcap * tanh(s / softcap)`` to the scaled scores.  ``learnable_sink`` (Hq,) adds one logit per
    head to the softmax denominator.  ``pack_gqa`` packs the query heads of a KV group into one tile (None:
    automatic).  ``deterministic`` concerns the backward only (the forward is always deterministic).
    ``page_table`` (B, max_pages_per_seq) int32: paged K/V, k/v (num_pages, page_size, Hkv, D), every sequence
    max_pages_per_seq * page_size keys long (``flash_attn_varlen_func`` takes per-sequence lengths in seqused_k);
    inference only (dropout with a page table raises).

    ``dropout_p`` in [0, 1]: attention dropout (Philox4x32-7; the keep mask is a function of (seed, offset,
    batch, head, query, key) only, see ``dropout.py`` and ``dropout_mask``).  Without ``dropout_seed`` the seed
    and offset come from torch's CUDA generator (``torch.manual_seed`` reproduces a call; each call advances
    the offset).  ``dropout_seed``: an int, or a CUDA int64 tensor of one value (required under CUDA-graph
    capture; change it between replays); ``dropout_offset``: an int (default 0 with a seed).  Dropout with
    num_splits != 1 (split-KV), block sparsity or paged K/V raises ValueError.
    ``num_splits``: None (default) splits an inference call automatically when its grid would leave SMs idle
    and each CTA would walk at least ``splitkv.AUTO_MIN_KEYS`` keys (as FlashAttention-2 does; never a call that
    needs grad, has dropout or block sparsity, runs under torch.compile, or is captured in a CUDA graph with a
    caller-given max_seqlen_k: splitkv.default_num_splits; switch: splitkv.DEFAULT_SPLITS_AUTO);
    1 no split; N > 1 splits the keys into N ranges whose fp32 partials are combined (inference only); <= 0 picks
    N from the problem size and the SM count (1 for a call that needs grad or under torch.compile).  ``block_sparse_tensors`` (``BlockSparseTensors``, e.g. from
    ``block_sparse_from_mask`` / ``block_sparse_from_flex``): visit only the listed blocks, forward and backward;
    ``block_sparse_tensors_bwd``: the same pairs in the KV-major form the dK/dV kernel walks (optional: built on the
    device from ``block_sparse_tensors`` when not given).  See block_sparse.py.

    FP8 (FlashAttention-3's API): q/k/v ``torch.float8_e4m3fn`` with ``q_descale``/``k_descale``/``v_descale``
    fp32 (B, Hkv) (missing: 1.0) and ``out_dtype`` bf16 (default) or fp16; inference only, dense, causal or not,
    sliding window, softcap, learnable sink, GQA (``pack_gqa``) and split-KV (``num_splits``) with the rules above, head dims
    64/128; any other feature raises before launch (dispatch_fp8.py; ``fp8_quant.quantize_qkv``
    makes the inputs).
    """
    if (q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
            or getattr(q, "dtype", None) in FP8_ANY or getattr(k, "dtype", None) in FP8_ANY
            or getattr(v, "dtype", None) in FP8_ANY):  # inline: every dense call asks (is_fp8 is a call more)
        return fp8_attention(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                             out_dtype=out_dtype, softmax_scale=softmax_scale, causal=causal,
                             window_size=window_size, return_lse=return_lse,
                             learnable_sink=learnable_sink, num_splits=num_splits, pack_gqa=pack_gqa,
                             softcap=softcap, unsupported=fp8_unsupported(
                                 softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                                 block_sparse_tensors=block_sparse_tensors, dropout_p=dropout_p,
                                 page_table=page_table, qv=qv, gather_kv_indices=gather_kv_indices,
                                 score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod,
                                 aux_tensors=aux_tensors, aux_scalars=aux_scalars,
                                 block_sparse_tensors_bwd=block_sparse_tensors_bwd, dropout_seed=dropout_seed,
                                 dropout_offset=dropout_offset))
    p = _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic, block_sparse_tensors_bwd)
    if qv is not None or gather_kv_indices is not None or aux_scalars is not None:
        _unsupported(qv=qv, gather_kv_indices=gather_kv_indices, aux_scalars=aux_scalars)
    return _attention(q, k, v, learnable_sink, return_lse, dict(
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, pack_gqa=pack_gqa,
        debug_checks=None, page_table=page_table, num_splits=num_splits,
        block_sparse_tensors=block_sparse_tensors, block_sparse_tensors_bwd=block_sparse_tensors_bwd,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset, deterministic=deterministic,
        mod_args=dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors),
    ), p)


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
    num_splits: int | None = None,
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
    block_sparse_tensors_bwd=None,
    dropout_seed: int | torch.Tensor | None = None,
    dropout_offset: int | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
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

    Paged K/V (flash-attn-4's ``page_table``): k/v are (num_pages, page_size, Hkv, D) (any page size >= 1; k and v
    may be two views of one fused cache), ``page_table`` int32 (B, max_pages_per_seq) maps the i-th page of a
    sequence to a page of k/v, ``seqused_k`` gives the lengths (default: every page full) and ``max_seqlen_k``
    defaults to max_pages_per_seq * page_size.  Rows of a last page past seqused_k are never read.  Cannot be
    combined with ``cu_seqlens_k`` or dropout; inference only (a call that needs grad raises).  Page indices are
    the caller's contract: the kernel clamps them to the pool, and the debug checks name a bad one.

    FP8: float8_e4m3fn q/k/v with (B, Hkv) fp32 descales, as ``flash_attn_func``'s (packed or dense q and k/v,
    cu_seqlens_q/k, seqused_k, paged e4m3 K/V with page_table; no seqused_q or debug_checks yet:
    dispatch_fp8_varlen.py), or a
    bf16/fp16 q over e4m3 k/v, quantized on the device per (sequence, KV head) (a q_descale then raises; the
    output in q's dtype unless out_dtype says otherwise).
    """
    if (q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
            or getattr(q, "dtype", None) in FP8_ANY or getattr(k, "dtype", None) in FP8_ANY
            or getattr(v, "dtype", None) in FP8_ANY):
        from .dispatch_fp8_varlen import fp8_varlen_attention

        return fp8_varlen_attention(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            out_dtype=out_dtype, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            return_lse=return_lse, learnable_sink=learnable_sink, num_splits=num_splits, pack_gqa=pack_gqa,
            max_seqlen_k=max_seqlen_k, page_table=page_table, softcap=softcap, unsupported=fp8_unsupported(
                softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, dropout_p=dropout_p,
                block_sparse_tensors=block_sparse_tensors, qv=qv,
                gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars, min_seqlen_k=min_seqlen_k,
                scheduler_metadata=scheduler_metadata, seqlen_k_per_split=seqlen_k_per_split,
                block_sparse_tensors_bwd=block_sparse_tensors_bwd, dropout_seed=dropout_seed,
                dropout_offset=dropout_offset, debug_checks=debug_checks or None))
    p = _check_common(num_splits, block_sparse_tensors, dropout_p, deterministic, block_sparse_tensors_bwd)
    if (qv is not None or gather_kv_indices is not None or aux_scalars is not None
            or min_seqlen_k is not None or scheduler_metadata is not None or seqlen_k_per_split is not None):
        _unsupported(qv=qv, gather_kv_indices=gather_kv_indices, aux_scalars=aux_scalars, min_seqlen_k=min_seqlen_k,
                     scheduler_metadata=scheduler_metadata, seqlen_k_per_split=seqlen_k_per_split)
    return _attention(q, k, v, learnable_sink, return_lse, dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, pack_gqa=pack_gqa, debug_checks=debug_checks,
        page_table=page_table, num_splits=num_splits, block_sparse_tensors=block_sparse_tensors,
        block_sparse_tensors_bwd=block_sparse_tensors_bwd,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset, deterministic=deterministic,
        mod_args=dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors),
    ), p)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    return_softmax_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    debug_checks: bool | None = None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = True,
    rotary_seqlens=None,
    cache_leftpad=None,
    alibi_slopes=None,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    cu_seqlens_k_new=None,
    scheduler_metadata=None,
    attention_chunk: int = 0,
    sm_margin: int = 0,
):
    """Attention of q over a KV cache, optionally appending new keys/values first (FlashAttention-2/3's
    ``flash_attn_with_kvcache``; inference only).

    q (B, Sq, Hq, D), or (total_q, Hq, D) with ``cu_seqlens_q`` (then without k/v).  The cache is contiguous,
    k_cache/v_cache (B_cache, S_cache, Hkv, D|Dv) with ``cache_batch_idx`` (B,) int32 choosing the row of each
    batch entry (default: entry b uses row b), or paged, (num_pages, page_size, Hkv, D|Dv) with ``page_table``
    (or its FlashAttention-2 name ``block_table``) int32 (B, max_pages_per_seq), any page size >= 1.  k/v may
    be views of one fused cache.

    ``k``/``v`` (B, S_new, Hkv, D|Dv), when given, are written into the cache at positions
    ``cache_seqlens[b] + i`` (crossing page boundaries as needed) before the attention, which then sees
    ``cache_seqlens + S_new`` keys.  ``cache_seqlens``: int or int32 (B,) tensor, the keys already in the cache
    (None: the whole cache, no append).  ``causal`` is bottom-right aligned (the new queries are the last
    positions).  ``num_splits``: 0 (the default, automatic: enough KV splits to fill the GPU), 1 (no split) or
    N > 1 (exactly N, combined by the split-KV combine kernel).

    No device->host sync and CUDA-graph capturable (give ``max_seqlen_q`` with ``cu_seqlens_q``).  Returns out
    (like q, last dim Dv), or ``(out, lse)`` with ``return_softmax_lse=True`` (lse fp32 (B, Hq, Sq) or
    (Hq, total_q)).  Rotary embedding, ALiBi, cache_leftpad and qv raise NotImplementedError.

    FP8: a float8_e4m3fn cache, contiguous or paged (page_table / block_table, any page size; the FP8 kernel looks
    each key row's page up), with (B, Hkv) fp32 k_descale/v_descale (FlashAttention-3's), and
    either a float8_e4m3fn q with its q_descale (bf16 output) or a bf16/fp16 q (an FP8 KV cache: q is quantized
    on the device per (batch, KV head) from its amax, output in q's dtype; a q_descale then raises).  Appended
    k/v are e4m3 under the cache's descales, or bf16/fp16, quantized on the way in with them (saturated to
    +-448), into pages too.  No cache_batch_idx or varlen q with FP8 yet (dispatch_fp8_varlen.py).
    """
    from . import kvcache as KV

    if rotary_cos is not None or rotary_sin is not None or rotary_seqlens is not None:
        raise NotImplementedError("rotary_cos/rotary_sin/rotary_seqlens: rotary embedding inside "
                                  "flash_attn_with_kvcache is not supported by flash-attn-4-sm120; apply the rotary "
                                  "embedding to q and k before the call and leave these at None")
    if q_descale is not None or k_descale is not None or v_descale is not None or is_fp8(q, k_cache, v_cache, k, v):
        from .dispatch_fp8_varlen import fp8_kvcache_attention

        if page_table is not None and block_table is not None and page_table is not block_table:
            compat.refuse("kvcache_block_table")
        out, lse = fp8_kvcache_attention(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, out_dtype=None, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            return_lse=return_softmax_lse, learnable_sink=learnable_sink, num_splits=num_splits, pack_gqa=pack_gqa,
            page_table=page_table if page_table is not None else block_table, softcap=softcap,
            unsupported=fp8_unsupported(
                softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa, dropout_p=0.0,
                cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q,
                alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad, qv=qv, cu_seqlens_k_new=cu_seqlens_k_new,
                scheduler_metadata=scheduler_metadata, debug_checks=debug_checks or None,
                attention_chunk=attention_chunk or None, sm_margin=sm_margin or None))
        return (out, lse) if return_softmax_lse else out
    if (alibi_slopes is not None or cache_leftpad is not None or qv is not None or cu_seqlens_k_new is not None
            or scheduler_metadata is not None):
        _unsupported(alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad, qv=qv,
                     cu_seqlens_k_new=cu_seqlens_k_new, scheduler_metadata=scheduler_metadata)
    if attention_chunk:
        raise NotImplementedError(f"attention_chunk={attention_chunk} is not supported by flash-attn-4-sm120; "
                                  "leave it at 0")
    if sm_margin:
        raise NotImplementedError(f"sm_margin={sm_margin} is not supported by flash-attn-4-sm120; leave it at 0")
    _check_common(num_splits, None, 0.0, False)
    compat.check_kvcache(needs_grad=_needs_grad(q, k_cache, v_cache, k, v, learnable_sink), page_table=page_table,
                         block_table=block_table, cache_batch_idx=cache_batch_idx,
                         varlen_q=cu_seqlens_q is not None, append=k is not None or v is not None)
    pages = page_table if page_table is not None else block_table
    varlen_q = cu_seqlens_q is not None
    V.check_tensor("q", q, 3 if varlen_q else 4)
    dev = q.device
    V.check_tensor("k_cache", k_cache, 4, dev)
    V.check_tensor("v_cache", v_cache, 4, dev)
    if varlen_q:
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of shape (batch + 1,)")
        batch = cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
        if max_seqlen_q is not None:
            # FlashAttention-3 callers (transformers' paged decode) pass it with a dense q too: the length is
            # q.shape[1] then, and a consistent value is accepted and not needed
            if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < q.shape[1]:
                raise ValueError(f"max_seqlen_q={max_seqlen_q!r} with a dense q must be an int >= q.shape[1] "
                                 f"({q.shape[1]}); it is only needed with cu_seqlens_q (or leave it at None)")
            max_seqlen_q = None
    if pages is not None:
        V.check_page_table(pages, k_cache, v_cache, batch, dev)
        capacity = pages.shape[1] * k_cache.shape[1]
    else:
        if tuple(k_cache.shape[:2]) != tuple(v_cache.shape[:2]):
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same "
                             "(batch, seqlen) dims")
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            V.check_index_tensor("cache_batch_idx", cache_batch_idx, batch, dev)
        elif k_cache.shape[0] < batch:
            raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {batch}; give cache_batch_idx or "
                             "a cache with one row per batch entry")
    new = KV.check_new_kv(k, v, k_cache, v_cache, batch, dev)
    if new and cache_seqlens is None:
        raise ValueError("cache_seqlens is required when appending k/v (it says where the new keys go)")
    seqlens = KV.check_cache_seqlens(cache_seqlens, batch, capacity, new, dev)
    if new:
        KV.append(k_cache, v_cache, k, v, seqlens, pages, cache_batch_idx)
    seqused_k = None if seqlens is None else (seqlens + new if new else seqlens)
    if pages is None and cache_batch_idx is not None:
        # a contiguous cache with a row per batch entry is a paged cache of B_cache pages of S_cache rows
        pages = cache_batch_idx.view(batch, 1)
    kc, vc = k_cache, v_cache
    if pages is None and k_cache.shape[0] > batch:
        kc, vc = k_cache[:batch], v_cache[:batch]  # rows b < batch, as FlashAttention reads them (views)
    out, lse = _attention(q, kc, vc, learnable_sink, return_softmax_lse, dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None, seqused_q=None, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=None, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, pack_gqa=pack_gqa, debug_checks=debug_checks, page_table=pages,
        num_splits=num_splits,
    ))
    return (out, lse) if return_softmax_lse else out


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seqused: torch.Tensor | None = None,
    varlen_batch_idx: torch.Tensor | None = None,
    return_lse: bool = True,
):
    """Combine the partial results of a split-KV attention (flash-attn-4 b36's signature and layouts).

    ``out_partial`` (num_splits, B, S, H, D) — or, varlen, (num_splits, total_q, H, D) — fp32 (bf16/fp16 also
    accepted), each split normalised by its own softmax sum; ``lse_partial`` fp32 (num_splits, B, S, H) /
    (num_splits, total_q, H), the natural-log LSE of each split, any strides.  Returns ``(out, lse)``: out
    (B, S, H, D) / (total_q, H, D) in ``out_dtype`` (default: out_partial's dtype) or written into ``out``; lse
    fp32 (B, S, H) / (total_q, H) (a view whose sequence dimension is contiguous), None when
    ``return_lse=False``.  A split with LSE = -inf is empty and contributes 0 (its out_partial is not read); a row
    whose splits are all empty gets out = 0 and lse = -inf; NaN propagates.  num_splits <= 256, head_dim a
    multiple of 8 up to 512.  Inference only: inputs that require grad raise.
    """
    if cu_seqlens is not None or seqused is not None or varlen_batch_idx is not None:
        _unsupported(cu_seqlens=cu_seqlens, seqused=seqused, varlen_batch_idx=varlen_batch_idx)
    return run_combine(out_partial, lse_partial, out=out, out_dtype=out_dtype, return_lse=return_lse)
