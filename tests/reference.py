"""Reference attention in plain PyTorch for the tests: fp32 (the ground truth) or the input dtype (the
"PyTorch in the same dtype" error yardstick)."""

from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window=(None, None), softcap=0.0, sink=None,
                  upcast=True, mask=None, keep=None, dropout_p=0.0, bias=None):
    """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D|Dv) -> out (B, Sq, Hq, Dv) in q.dtype, lse (B, Hq, Sq) fp32.

    Masks follow FlashAttention: query i sees key j iff j <= i + Sk - Sq (+ right) and j >= i + Sk - Sq - left.
    ``mask``: an explicit boolean (B|1, Hq|1, Sq, Sk) mask of allowed entries, ANDed with the others.
    ``bias``: an fp32 (B|1, Hq|1, Sq, Sk) tensor added to the scaled (capped) scores (a score_mod's bias).
    Rows that see nothing give out = 0 and lse = -inf (or the sink logit).
    Dropout: ``keep`` (B, Hq, Sq, Sk) bool, as from ``dropout_mask``; the LSE is the undropped one and
    out = (P * keep / (1 - dropout_p)) V.
    """
    dtype = q.dtype
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale if not upcast else q, k)
    if upcast:
        s = s * scale
    s = s.float()
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.float()
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    shift = sk - sq
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right is not None and right >= 0:
        allowed &= j <= i + shift + right
    if left is not None and left >= 0:
        allowed &= j >= i + shift - left
    s = s.masked_fill(~allowed, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.float().view(1, hq, 1, 1).expand(b, hq, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows with lse = -inf
    if sink is not None:
        p = p[..., :sk]
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    p = p if upcast else p.to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out.to(dtype), lse


def sparse_allowed(visited, full, sq, sk, causal=False, window=(None, None)):
    """Element mask of a block-sparse call: keys in a listed block, with causal/window applied to mask blocks
    (``visited`` and not ``full``) only; ``visited``/``full`` (B|1, H|1, sq, sk) bool."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=visited.device)[:, None]
    j = torch.arange(sk, device=visited.device)[None, :]
    win = torch.ones(sq, sk, dtype=torch.bool, device=visited.device)
    if right is not None and right >= 0:
        win &= j <= i + sk - sq + right
    if left is not None and left >= 0:
        win &= j >= i + sk - sq - left
    return visited & (full | win)


def varlen_ref(q, k, v, cu_q, cu_k, used_q=None, used_k=None, keep_of=None, **kw):
    """Reference for packed (total, H, D) inputs: the dense reference per sequence.  Rows past seqused_q are
    not compared (returned as NaN); lse is (Hq, total_q).  ``keep_of(b, lq, lk)``: the dropout keep mask of
    sequence b, (1, Hq, lq, lk)."""
    total_q, hq = q.shape[0], q.shape[1]
    out = torch.full((total_q, hq, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, total_q), float("nan"), dtype=torch.float32, device=q.device)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for bi in range(len(cu_q) - 1):
        q0, k0 = cu_q[bi], cu_k[bi]
        lq = cu_q[bi + 1] - q0 if used_q is None else int(used_q[bi])
        lk = cu_k[bi + 1] - k0 if used_k is None else int(used_k[bi])
        if lq == 0:
            continue
        qb = q[q0:q0 + lq][None]
        kb, vb = k[k0:k0 + lk][None], v[k0:k0 + lk][None]
        if lk == 0:
            o = torch.zeros_like(out[q0:q0 + lq])
            sink = kw.get("sink")
            l_ = (sink.float()[:, None].expand(hq, lq) if sink is not None
                  else torch.full((hq, lq), -math.inf, device=q.device))
            out[q0:q0 + lq], lse[:, q0:q0 + lq] = o, l_
            continue
        extra = {} if keep_of is None else {"keep": keep_of(bi, lq, lk)}
        o, l_ = attention_ref(qb, kb, vb, **kw, **extra)
        out[q0:q0 + lq] = o[0]
        lse[:, q0:q0 + lq] = l_[0]
    return out, lse


def combine_ref(out_partial, lse_partial):
    """Split-KV combine in fp64: out_partial (splits, ..., D), lse_partial (splits, ...) -> out (..., D), lse (...).

    Weights exp(lse_i - LSE); an empty split (lse_i = -inf) contributes exactly 0 whatever its out_partial holds;
    a row whose splits are all empty gives out = 0, lse = -inf; NaN propagates."""
    lp = lse_partial.double()
    lse = torch.logsumexp(lp, dim=0)  # -inf when every split is empty
    empty = lp == -math.inf
    w = torch.where(empty, torch.zeros_like(lp), torch.exp(lp - lse))
    op = torch.where(empty[..., None], torch.zeros_like(out_partial, dtype=torch.float64), out_partial.double())
    return (w[..., None] * op).sum(0), lse


def split_partials(q, k, v, num_splits, **kw):
    """Partial results of attention over ``num_splits`` contiguous KV chunks (the last ones may be empty), in
    flash-attn-4's combine layout: out_partial fp32 (splits, B, Sq, Hq, Dv), lse_partial fp32 (splits, B, Sq, Hq).
    Empty chunks get out 0 and lse -inf.  (No masks: each chunk sees all its keys.)"""
    b, sq, hq = q.shape[:3]
    sk = k.shape[1]
    per = -(-sk // num_splits)
    outs, lses = [], []
    for i in range(num_splits):
        lo, hi = min(i * per, sk), min((i + 1) * per, sk)
        if hi == lo:
            outs.append(torch.zeros((b, sq, hq, v.shape[-1]), dtype=torch.float32, device=q.device))
            lses.append(torch.full((b, sq, hq), -math.inf, dtype=torch.float32, device=q.device))
            continue
        o, l_ = attention_ref(q.float(), k[:, lo:hi].float(), v[:, lo:hi].float(), **kw)
        outs.append(o.float())
        lses.append(l_.transpose(1, 2).float())
    return torch.stack(outs), torch.stack(lses)


def dpsum_ref(dout, out, dlse=None, varlen_q=False, dtype=torch.float32):
    """The backward's D = rowsum(dO * O) - dLSE in ``dtype`` (the expression the preprocess kernel replaced), in
    the LSE layout: dout/out (B, S, H, D) -> (B, H, S); varlen (total, H, D) -> (H, total).  Also returns
    sum |dO * O| + |dLSE|, the scale of the fp32 rounding error a kernel summing in another order may make."""
    prod = dout.to(dtype) * out.to(dtype)
    d, mag = prod.sum(-1), prod.abs().sum(-1)
    d, mag = (d.transpose(0, 1), mag.transpose(0, 1)) if varlen_q else (d.transpose(1, 2), mag.transpose(1, 2))
    d, mag = d.contiguous(), mag.contiguous()
    if dlse is not None:
        d = d - dlse.to(dtype)
        mag = mag + dlse.to(dtype).abs()
    return d, mag
