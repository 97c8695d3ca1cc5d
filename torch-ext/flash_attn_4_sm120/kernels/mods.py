"""A small library of score and mask mods (CuTe-DSL device code; importing this module imports CuTe-DSL).

Reached as ``flash_attn_4_sm120.mods`` (loaded on first access).  Each factory returns a dict of mods to splat
into the call, in upstream flash-attn-4's convention (modspec.py):

    from flash_attn_4_sm120 import flash_attn_func, mods
    out, _ = flash_attn_func(q, k, v, **mods.alibi(), aux_tensors=[slopes])      # slopes: fp32 (Hq,)
    out, _ = flash_attn_func(q, k, v, **mods.document(), aux_tensors=[doc_ids])  # doc_ids: int32 (S,)

Masks (``mask_mod``; True keeps the score):
  * ``causal()``: key <= query + (seqlen_k - seqlen_q), bottom-right aligned like ``causal=True``.
  * ``sliding_window(left, right)``: keys within [query - left, query + right] of the bottom-right diagonal,
    like ``window_size=(left, right)``.
  * ``document(causal=False)``: keys of the query's document only.  aux_tensors[0] holds int32 document ids of
    the rows of q/k (``document_ids(offsets, n)`` builds them on the device from cu_seqlens-like offsets, with no
    host sync); a row is looked up at ``seqlen_info.offset + position``, so one id tensor serves a varlen call
    over the packed tensor, and a dense call's batch entries share it (length >= S).
  * ``prefix_lm(prefix_len=None)``: bidirectional over the first ``prefix_len`` keys, causal (top-left) after;
    with ``prefix_len=None`` aux_tensors[0] holds int32 prefix lengths per batch entry (B,).
Biases (``score_mod`` + ``score_mod_bwd``; the gradient w.r.t. the score is 1):
  * ``alibi()``: score - slopes[h] * |q - k| (flex-attention's symmetric ALiBi, top-left), aux_tensors[0] fp32
    slopes (Hq,).
  * ``relative_bias(max_distance)``: score + table[h, clamp(k - q, -M, M) + M], aux_tensors[0] fp32
    (Hq, 2M + 1).  The table gets no gradient: upstream flash-attn-4 has no mechanism for gradients of aux
    tensors, and neither has this bundle (learn the table elsewhere, or keep it frozen).
"""

from __future__ import annotations

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def _tag(factory: str, args: tuple, **fns) -> dict:
    """Mark each mod with its recipe (factory, args) so configs holding it can be pickled (the compile gate)."""
    for fn in fns.values():
        fn.__fa4_recipe__ = (factory, args)
    return fns


def _ssa(x, dtype=Int32):
    t = cute.make_rmem_tensor(1, dtype)
    t[0] = x
    return t.load()


def _load(t: cute.Tensor, idx):
    """One aux element as a size-1 fp32 TensorSSA."""
    r = cute.make_rmem_tensor(1, t.element_type)
    r[0] = t[idx]
    return r.load().to(Float32)


# ---- masks -----------------------------------------------------------------------------------------------------
@cute.jit
def causal_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    diag = _ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q)
    return kv_idx <= q_idx + diag


def causal() -> dict:
    """Causal mask, bottom-right aligned (``causal=True``'s)."""
    return _tag("causal", (), mask_mod=causal_mask)


def sliding_window(left: int, right: int = 0) -> dict:
    """Keys within [q - left, q + right] of the bottom-right diagonal (``window_size=(left, right)``)."""
    if isinstance(left, bool) or isinstance(right, bool) or not isinstance(left, int) or not isinstance(right, int) \
            or left < 0 or right < 0:
        raise ValueError(f"sliding_window(left, right) takes ints >= 0, got ({left!r}, {right!r})")

    @cute.jit
    def sliding_window_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        center = q_idx + _ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q)
        return (kv_idx >= center - _ssa(left)) & (kv_idx <= center + _ssa(right))

    return _tag("sliding_window", (left, right), mask_mod=sliding_window_mask)


def document(causal: bool = False) -> dict:
    """Keys of the query's document (aux_tensors[0]: int32 document id per row, see ``document_ids``)."""
    if not isinstance(causal, bool):
        raise ValueError(f"document(causal=) takes a bool, got {causal!r}")

    @cute.jit
    def document_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        ids = aux_tensors[0]
        q_doc = _ssa(ids[seqlen_info.offset_q + q_idx[0]])
        k_doc = _ssa(ids[seqlen_info.offset_k + kv_idx[0]])
        keep = q_doc == k_doc
        if cutlass.const_expr(causal):
            keep = keep & (kv_idx <= q_idx + _ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q))
        return keep

    return _tag("document", (causal,), mask_mod=document_mask)


def document_ids(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """int32 document id of each of ``length`` rows from cu_seqlens-like ``offsets`` (D + 1,) (row t belongs to
    document i when offsets[i] <= t < offsets[i + 1]; rows outside every document get -1: they see each other and
    nothing else).  On the device,
    no host sync."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError("offsets must be a 1-D int32/int64 tensor of cu_seqlens-like document starts")
    t = torch.arange(length, device=offsets.device, dtype=offsets.dtype)
    ids = torch.searchsorted(offsets, t, right=True) - 1
    inside = (ids >= 0) & (t < offsets[-1])
    return torch.where(inside, ids, torch.full_like(ids, -1)).to(torch.int32)


def prefix_lm(prefix_len: int | None = None) -> dict:
    """Bidirectional over the first ``prefix_len`` keys, causal (top-left, key <= query) after them.
    ``prefix_len=None``: aux_tensors[0] holds int32 prefix lengths (B,)."""
    if prefix_len is not None and (isinstance(prefix_len, bool) or not isinstance(prefix_len, int)
                                   or prefix_len < 0):
        raise ValueError(f"prefix_lm(prefix_len=) takes an int >= 0 or None, got {prefix_len!r}")

    @cute.jit
    def prefix_lm_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        if cutlass.const_expr(prefix_len is None):
            prefix = _ssa(aux_tensors[0][b_idx[0]])
        else:
            prefix = _ssa(prefix_len)
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return _tag("prefix_lm", (prefix_len,), mask_mod=prefix_lm_mask)


# ---- biases ----------------------------------------------------------------------------------------------------
def _identity_grad():
    @cute.jit
    def score_grad_identity(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        """The backward of an additive bias: d(score + bias)/d score = 1."""
        return grad

    return score_grad_identity


def alibi() -> dict:
    """score - slopes[h] * |q - k| (aux_tensors[0]: fp32 slopes (Hq,))."""

    @cute.jit
    def alibi_score(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slope = _load(aux_tensors[0], h_idx[0])
        d = q_idx[0] - kv_idx[0]
        return score - slope * _ssa(cutlass.max(d, -d)).to(Float32)

    alibi_score.__vec_size__ = 1
    return _tag("alibi", (), score_mod=alibi_score, score_mod_bwd=_identity_grad())


def relative_bias(max_distance: int) -> dict:
    """score + table[h, clamp(k - q, -M, M) + M] (aux_tensors[0]: fp32 (Hq, 2M + 1) with M = max_distance)."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"relative_bias(max_distance) takes an int >= 0, got {max_distance!r}")

    @cute.jit
    def relative_bias_score(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        rel = cutlass.min(cutlass.max(kv_idx[0] - q_idx[0], -max_distance), max_distance) + max_distance
        return score + _load(aux_tensors[0], (h_idx[0], rel))

    relative_bias_score.__vec_size__ = 1
    return _tag("relative_bias", (max_distance,), score_mod=relative_bias_score, score_mod_bwd=_identity_grad())


__all__ = ["alibi", "causal", "causal_mask", "document", "document_ids", "prefix_lm",
           "relative_bias", "sliding_window"]
