"""Autograd for the attention ops: forward saves (q, k, v, out, lse), backward runs bwd_kernel.py.

Two kernels, no atomics, so gradients are bitwise reproducible whatever ``deterministic`` says:
bwd_kernel.py (KV-stationary) writes dK/dV, bwd_dq_kernel.py (Q-stationary) writes dQ.  Host-side pieces,
O(tokens) and cheap next to the kernels:
  * D = rowsum(dO * O) (minus dLSE when the caller differentiates through the returned LSE);
  * dQ/dK/dV start at zero, so rows no query/key reaches get gradient 0;
  * the learnable-sink gradient is closed-form: d sink_h = -sum_i exp(sink_h - lse_i) * D_i over valid rows.
"""

from __future__ import annotations

import math

import torch

from . import validate as V
from .config import select_bwd_config, select_dq_config


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, kw, deterministic=False):
        from .interface import _forward

        out, lse, meta, sink = _forward(q.detach(), k.detach(), v.detach(),
                                        learnable_sink=learnable_sink, needs_grad=True, **kw)
        ctx.save_for_backward(q, k, v, out, lse, sink, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"],
                              kw["seqused_k"])
        ctx.meta = meta
        ctx.deterministic = deterministic
        ctx.sink_dtype = None if learnable_sink is None else learnable_sink.dtype
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        dq, dk, dv, dsink = flash_attn_backward(
            dout, q, k, v, out, lse, ctx.meta, sink=sink, dlse=dlse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            seqused_q=used_q, seqused_k=used_k, deterministic=ctx.deterministic,
        )
        if dsink is not None and ctx.sink_dtype is not None:
            dsink = dsink.to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None, None


def _row_valid(lse, meta, cu_q, used_q):
    """Bool mask shaped like lse: rows inside their sequence (seqused/cu_seqlens), False elsewhere."""
    if cu_q is None:
        b, _, sq = lse.shape
        if used_q is None:
            return None
        pos = torch.arange(sq, device=lse.device)
        return (pos[None, :] < used_q[:, None]).unsqueeze(1).expand(b, lse.shape[1], sq)
    total = lse.shape[1]
    t = torch.arange(total, device=lse.device, dtype=torch.int32)
    bidx = torch.searchsorted(cu_q, t, right=True) - 1
    inside = (bidx >= 0) & (bidx < cu_q.shape[0] - 1)
    bsafe = bidx.clamp(0, cu_q.shape[0] - 2)
    if used_q is not None:
        inside &= (t - cu_q[bsafe]) < used_q[bsafe]
    return inside.unsqueeze(0).expand_as(lse)


def flash_attn_backward(dout, q, k, v, out, lse, meta, *, sink=None, dlse=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, seqused_q=None, seqused_k=None, deterministic=False):
    """Gradients (dq, dk, dv, dsink) of the forward described by ``meta`` (interface.FwdMeta).

    Always deterministic (``deterministic`` is accepted for API compatibility and changes nothing): the atomic-
    free pair of kernels was also the faster one on the H100 proxy (1.2-2.3x over dQ by fp32 atomics)."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    dout = dout.contiguous() if dout.stride(-1) != 1 or dout.data_ptr() % 16 else dout
    V.check_tensor("dout", dout, out.dim(), q.device)
    hq, d = q.shape[-2:]
    hkv, dv_dim = k.shape[-2], v.shape[-1]
    dtype = V._DTYPES[q.dtype]
    # D = rowsum(dO * O), laid out like lse: (B, Hq, Sq) or (Hq, total_q)
    dpsum = (dout.float() * out.float()).sum(-1)
    dpsum = dpsum.transpose(0, 1) if varlen_q else dpsum.transpose(1, 2)
    if dlse is not None:
        dpsum = dpsum - dlse
    dpsum = dpsum.contiguous()
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    pdpsum = torch.zeros_like(lse)  # sum_j P dP per row, in fp32, from the dQ kernel (for the sink gradient)
    if meta.max_q > 0 and meta.max_k > 0 and q.numel() and k.numel():
        flags = dict(windowed=meta.windowed, has_softcap=meta.softcap > 0, varlen_q=varlen_q, varlen_k=varlen_k,
                     seqused_q=seqused_q is not None, seqused_k=seqused_k is not None)
        cfg = select_bwd_config(dtype, d, dv_dim, **flags)
        if meta.softcap > 0:
            scale_log2, prescale = meta.softcap * math.log2(math.e), meta.scale / meta.softcap
        else:
            scale_log2, prescale = meta.scale * math.log2(math.e), 1.0
        from .jit import get_bwd_kernel, get_dq_kernel

        kernel = get_bwd_kernel(cfg)
        with torch.cuda.device(q.device):
            kernel(
                q.detach(), k.detach(), v.detach(), dout, lse, dpsum, dk, dv, cu_seqlens_q, cu_seqlens_k,
                seqused_q, seqused_k, scale_log2, prescale, meta.scale, meta.left, meta.right, hq // hkv,
                -(-meta.max_k // cfg.tile_n), hkv, meta.batch,
            )
            dq_cfg = select_dq_config(dtype, d, dv_dim, **flags)
            get_dq_kernel(dq_cfg)(
                q.detach(), k.detach(), v.detach(), dout, lse, dpsum, dq, pdpsum, cu_seqlens_q, cu_seqlens_k,
                seqused_q, seqused_k, scale_log2, prescale, meta.scale, meta.left, meta.right, hq // hkv,
                -(-meta.max_q // dq_cfg.tile_m), hq, meta.batch,
            )
    dsink = None
    if sink is not None:
        # d sink_h = -sum_i p_sink,i * D_i with p_sink,i = exp(sink_h - lse_i) and D_i = sum_j P_ij dP_ij (fp32)
        # minus dLSE_i; rows outside their sequence do not count
        d_exact = pdpsum - dlse if dlse is not None else pdpsum
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
        p_sink = torch.exp(sink.view(-1, 1) - lse_safe) if varlen_q else torch.exp(sink.view(1, -1, 1) - lse_safe)
        contrib = p_sink * d_exact
        valid = _row_valid(lse, meta, cu_seqlens_q, seqused_q)
        if valid is not None:
            contrib = torch.where(valid, contrib, torch.zeros_like(contrib))
        dsink = -(contrib.sum(-1) if varlen_q else contrib.sum((0, 2)))
    return dq, dk, dv, dsink
