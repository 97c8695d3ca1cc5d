"""FP8 (e4m3) forward for ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``: both become the kernel's
packed-rows form (kernels/fwd_fp8.py, ``Fp8FwdConfig.varlen``) — q (1, total_q, Hq, D), k/v (1, total_k, Hkv, D),
int32 cu_seqlens_q / cu_seqlens_k / seqused_k — and ``dispatch_fp8.run_fp8_packed`` launches it.

* varlen: packed q and/or k/v with cu_seqlens_q / cu_seqlens_k, seqused_k capping each sequence's keys; a dense
  side is flattened (a view) with its cu_seqlens made on the device (``arange(B + 1) * S``).
* kvcache: a contiguous cache (B_cache >= B, S_cache, Hkv, D), rows b < B read as dense K/V with
  seqused_k = cache_seqlens (+ the appended keys); new k/v are written into the cache first (the same indexed
  writes as the bf16 path, on uint8 views: torch has no index_put for float8).  e4m3 k/v are the caller's values
  under the cache's k_descale / v_descale; bf16/fp16 k/v are quantized on the way in with those descales
  (``fp8_quant.quantize_with_descale``: x / descale saturated to +-448).  The query is e4m3 with its q_descale, or
  bf16/fp16 (an FP8 KV cache under a high-precision model), the output then in q's dtype: the kernel reads it as
  is and quantizes each tile row (a (query row, head) pair) with its own amax scale (``Fp8FwdConfig.q_dtype``;
  ``quantize_in_kernel``).  Only a call whose out_dtype differs from q's takes the host's per-(batch, KV head)
  quantization first (``fp8_quant.quantize_query``): the kernel's bf16/fp16-query forms write q's dtype.

Refused before launch (NotImplementedError naming the argument): paged K/V (page_table / block_table),
cache_batch_idx, varlen q in the cache call, seqused_q, and the features ``flash_attn_func``'s FP8 path refuses;
ValueError for a q_descale with a bf16/fp16 q.  ``flash_attn_varlen_func`` takes a bf16/fp16 q over e4m3 k/v too:
the same rule (the host fallback for packed rows: ``fp8_quant.quantize_query_packed``, one scale per (sequence,
KV head), each row finding its sequence in cu_seqlens_q on the device).
Descales are (B, Hkv) per sequence.  No host read of a device value, but a varlen call's missing max_seqlen_q
(``validate.max_len``: read once, as the bf16 path).
"""

from __future__ import annotations

import torch

from . import compat
from . import dispatch_fp8 as F8
from . import fp8_quant as Q
from .fp8_rows import dense_cu, flatten, flatten_q, uniform_lengths, unpack
from . import validate as V

_E4 = torch.float8_e4m3fn
_APPEND = (_E4, torch.bfloat16, torch.float16)  # what may be appended into an e4m3 cache


def quantize_in_kernel(q, out_dtype) -> bool:
    """Whether the kernel quantizes this bf16/fp16 q itself (per tile row; no torch kernel on the host): yes unless
    out_dtype differs from q's dtype (the kernel's bf16/fp16-query forms write q's dtype; config_fp8)."""
    return out_dtype == q.dtype


def kernel_query(q):
    """A bf16/fp16 q as the kernel reads it: unit last stride, 16-byte aligned rows and start, and (dense) a batch
    stride of seqlen x row stride (flatten_q's packed-rows view).  A copy in q's dtype only when q is not so laid
    out (``empty`` strides are canonical even where torch's is_contiguous ignores a size-1 dim's stride)."""
    ok = q.stride(-1) == 1 and not any(s % 8 for s in q.stride()[:-1]) and q.data_ptr() % 16 == 0
    if q.dim() == 4 and q.shape[0] > 1 and q.shape[1] > 0:
        ok = ok and q.stride(0) == q.shape[1] * q.stride(1)
    if ok:
        return q
    return torch.empty(tuple(q.shape), dtype=q.dtype, device=q.device).copy_(q)


def _query(q, descales, hkv, out_torch, cu_seqlens_q=None):
    """(q, descales) for the launch of a bf16/fp16 q: the kernel's per-row quantization, or the host's fallback."""
    if quantize_in_kernel(q, out_torch):
        return kernel_query(q), (None,) + tuple(descales[1:])
    q, qd = Q.quantize_query_packed(q, hkv, cu_seqlens_q) if cu_seqlens_q is not None else Q.quantize_query(q, hkv)
    return q, (qd,) + tuple(descales[1:])


def _check_lengths(name, t, length, device):
    if t is None:
        return
    V.check_index_tensor(name, t, length, device)


def fp8_varlen_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, q_descale,
                         k_descale, v_descale, out_dtype, softmax_scale, causal, window_size, return_lse,
                         learnable_sink, unsupported: dict, num_splits=None, pack_gqa=None, max_seqlen_k=None,
                         page_table=None, softcap=0.0):
    """The FP8 branch of ``flash_attn_varlen_func`` -> (out, lse or None), out like q (last dim Dv).
    ``num_splits`` / ``pack_gqa``: the bf16 path's rules (dispatch_fp8.default_splits / fp8_pack); an int
    ``max_seqlen_k`` bounds the automatic split count's KV extent (else k's rows: never a device read).
    ``page_table`` (B, max_pages) int32: k/v are e4m3 page pools (num_pages, page_size, Hkv, D), each sequence's
    keys counted by seqused_k (default: the table's capacity); cu_seqlens_k is refused with it, as the bf16 path
    (compat ``paged_cu_seqlens_k``)."""
    needs_grad = F8.entry_checks(q, k, v, q_descale, k_descale, v_descale, out_dtype, learnable_sink)
    paged = page_table is not None
    if paged and cu_seqlens_k is not None:
        compat.refuse("paged_cu_seqlens_k")
    unsupported = dict(unsupported)
    unsupported["seqused_q"] = seqused_q is not None
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is not None and (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 1):
            raise ValueError(f"{name} must be a 1-D int32 tensor of shape (batch + 1,)")
    if varlen_q:
        batch = cu_seqlens_q.shape[0] - 1
    elif varlen_k:
        batch = cu_seqlens_k.shape[0] - 1
    else:
        batch = getattr(q, "shape", (0,))[0]
    descales, out_name, out_torch = F8.check_fp8_call(
        q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
        needs_grad=needs_grad, unsupported=unsupported, varlen_q=varlen_q, varlen_k=varlen_k, batch=batch,
        query_quantized_here=True, paged=paged)
    dev = q.device
    if paged:
        V.check_page_table(page_table, k, v, batch, dev)
    F8.fp8_pack(pack_gqa, q.shape[-2], k.shape[-2], 0)  # names a bad value before any work
    F8.fp8_scales(softmax_scale, softcap, q.shape[-1])
    _check_lengths("cu_seqlens_q", cu_seqlens_q, batch + 1, dev)
    _check_lengths("cu_seqlens_k", cu_seqlens_k, batch + 1, dev)
    _check_lengths("seqused_k", seqused_k, batch, dev)
    if q.dtype != _E4:  # a bf16/fp16 query over e4m3 K/V (check_fp8_call let only those through)
        q, descales = _query(q, descales, k.shape[-2], out_torch, cu_seqlens_q if varlen_q else None)
    qp = q.unsqueeze(0) if varlen_q else flatten_q(q)
    cu_q = cu_seqlens_q if varlen_q else dense_cu(batch, q.shape[1], dev)
    if paged:  # the pools themselves, no cu_seqlens_k: the kernel's paged form
        kp, vp, cu_k = k, v, None
        capacity = page_table.shape[1] * k.shape[1]
        used_k = seqused_k if seqused_k is not None else uniform_lengths(batch, capacity, dev)
    else:
        kp = k.unsqueeze(0) if varlen_k else flatten(k, "k")
        vp = v.unsqueeze(0) if varlen_k else flatten(v, "v")
        cu_k = cu_seqlens_k if varlen_k else dense_cu(batch, k.shape[1], dev)
        used_k = seqused_k if seqused_k is not None else (
            uniform_lengths(batch, k.shape[1], dev) if not varlen_k else cu_k[1:] - cu_k[:-1])
    max_q = V.max_len(cu_seqlens_q, None, qp.shape[1], "q", max_seqlen_q) if varlen_q else q.shape[1]
    max_k = max_seqlen_k if max_seqlen_k.__class__ is int else (None if varlen_k else
                                                                (capacity if paged else k.shape[1]))
    splits = F8.default_splits(num_splits, q, k, causal=causal, window_size=window_size, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_k=max_seqlen_k if max_seqlen_k.__class__ is int else None,
                               page_table=page_table)
    out, lse = F8.run_fp8_packed(qp, kp, vp, cu_q, cu_k, used_k, max_q, descales, softmax_scale=softmax_scale,
                                 causal=causal, out_name=out_name, out_dtype=out_torch, window_size=window_size,
                                 learnable_sink=learnable_sink, pack_gqa=pack_gqa, num_splits=splits,
                                 max_seqlen_k=max_k, rows_covered=not varlen_q,
                                 page_table=_table_rows(page_table) if paged else None, softcap=softcap)
    return unpack(out, lse, batch, 0 if varlen_q else q.shape[1], not varlen_q, return_lse)


def _check_new(k, v, k_cache, v_cache, batch):
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values to append) must be given together")
    if k is None:
        return 0
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if not isinstance(new, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(new).__name__}")
        if new.dtype not in _APPEND:
            raise (NotImplementedError if new.dtype == torch.float8_e5m2 else ValueError)(
                f"{name} has dtype {new.dtype}; appending into a float8_e4m3fn cache takes float8_e4m3fn {name} "
                "(already scaled by the cache's descale) or bfloat16/float16 (quantized here with it)")
        if new.dim() != 4 or new.shape[0] != batch or new.shape[2:] != cache.shape[2:] or new.shape[1] != k.shape[1]:
            raise ValueError(f"{name} {tuple(new.shape)} must be (batch={batch}, S_new, Hkv, D) with the heads and "
                             f"head dim of {name}_cache {tuple(cache.shape)} and one S_new")
        if new.device != cache.device:
            raise ValueError(f"{name} is on {new.device}, {name}_cache on {cache.device}")
    return k.shape[1]


def _table_rows(page_table):
    """The page table as the kernel's (B, max_pages) int32 with a unit column stride (a one-column table may carry
    any stride there: a view, never a copy)."""
    if page_table.shape[1] == 1 and page_table.stride(1) != 1:
        return page_table.as_strided(tuple(page_table.shape), (page_table.stride(0), 1), page_table.storage_offset())
    return page_table


def fp8_kvcache_attention(q, k_cache, v_cache, k, v, *, cache_seqlens, q_descale, k_descale, v_descale, out_dtype,
                          softmax_scale, causal, window_size, return_lse, learnable_sink, unsupported: dict,
                          num_splits=0, pack_gqa=None, page_table=None, softcap=0.0):
    """The FP8 branch of ``flash_attn_with_kvcache`` over a contiguous or paged cache -> (out, lse or None).
    ``num_splits`` (default 0: automatic, from the grid and the SM count) and ``pack_gqa`` as the bf16 cache
    path (splitkv.resolve_num_splits, plan.choose_pack).  ``page_table`` (B, max_pages) int32 (or its
    FlashAttention-2 name block_table, resolved by the caller): k_cache/v_cache are e4m3 page pools (num_pages,
    page_size, Hkv, D), any page size >= 1 (validate.check_page_table, the bf16 path's rules); appends go
    through kvcache.append's paged writes on uint8 views, the kernel reads rows through the table."""
    from . import kvcache as KV

    needs_grad = F8.entry_checks(q, k_cache, v_cache, q_descale, k_descale, v_descale, out_dtype, learnable_sink,
                                 k, v)
    if needs_grad:
        compat.refuse("kvcache_grad")
    batch = getattr(q, "shape", (0,))[0]
    paged = page_table is not None
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be a " + ("paged cache (num_pages, page_size, Hkv, D)" if paged else
                                                     "contiguous cache (B_cache, S_cache, Hkv, D)")
                             + f" here, got {tuple(getattr(c, 'shape', ())) or type(c).__name__}")
        if not paged and c.shape[0] < batch:
            raise ValueError(f"{name} has {c.shape[0]} rows for a batch of {batch}; a cache with one row per batch "
                             "entry is needed (cache_batch_idx is not supported with FP8 yet)")
    kc, vc = (k_cache, v_cache) if paged else (k_cache[:batch], v_cache[:batch])
    descales, out_name, out_torch = F8.check_fp8_call(
        q, kc, vc, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
        needs_grad=False, unsupported=unsupported, query_quantized_here=True, paged=paged)
    dev = q.device
    if paged:  # ValueError naming the table's dtype / shape / device / the pools' page dims
        V.check_page_table(page_table, k_cache, v_cache, batch, dev)
        capacity = page_table.shape[1] * k_cache.shape[1]
    elif k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same "
                         "(batch, seqlen) dims")
    else:
        capacity = k_cache.shape[1]
    # the split count, pack_gqa and softcap are checked before anything is written into the cache
    F8.fp8_scales(softmax_scale, softcap, q.shape[-1])
    splits = F8.default_splits(0 if num_splits is None else num_splits, q, k_cache, causal=causal,
                               window_size=window_size)
    F8.fp8_pack(pack_gqa, q.shape[2], k_cache.shape[2], q.shape[1])
    new = _check_new(k, v, k_cache, v_cache, batch)
    if new and cache_seqlens is None:
        raise ValueError("cache_seqlens is required when appending k/v (it says where the new keys go)")
    seqlens = KV.check_cache_seqlens(cache_seqlens, batch, capacity, new, dev)
    if not paged:
        kp, vp = flatten(kc, "k_cache"), flatten(vc, "v_cache")  # before the append: a bad layout writes nothing
    if new:
        k8, v8 = (x if x.dtype == _E4 else Q.quantize_with_descale(x, d) for x, d in ((k, descales[1]),
                                                                                        (v, descales[2])))
        KV.append(k_cache.view(torch.uint8), v_cache.view(torch.uint8), k8.view(torch.uint8), v8.view(torch.uint8),
                  seqlens, page_table, None)
    if paged:
        kp, vp, cu_k = k_cache, v_cache, None  # the pools themselves: the kernel's paged form reads no cu_seqlens_k
    else:
        cu_k = dense_cu(batch, k_cache.shape[1], dev)
    used_k = (uniform_lengths(batch, capacity, dev) if seqlens is None else (seqlens + new if new else seqlens))
    if q.dtype != _E4:  # a bf16/fp16 query over the e4m3 cache (check_fp8_call let only those through)
        q, descales = _query(q, descales, k_cache.shape[2], out_torch)
    qp = flatten_q(q)
    out, lse = F8.run_fp8_packed(qp, kp, vp, dense_cu(batch, q.shape[1], dev), cu_k, used_k, q.shape[1],
                                 descales, softmax_scale=softmax_scale, causal=causal, out_name=out_name,
                                 out_dtype=out_torch, window_size=window_size, learnable_sink=learnable_sink,
                                 pack_gqa=pack_gqa, num_splits=splits, max_seqlen_k=capacity, rows_covered=True,
                                 page_table=_table_rows(page_table) if paged else None, softcap=softcap)
    return unpack(out, lse, batch, q.shape[1], True, return_lse)
