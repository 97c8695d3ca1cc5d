"""Autograd for the attention: the forward saves (q, k, v, out, lse) and the metadata, the backward runs the two
backward kernels through dispatch_bwd.run_backward.  ``deterministic`` travels in the metadata (FwdMeta), which
picks the backward's kernels."""

from __future__ import annotations

import torch

from .dispatch import run_forward
from .dispatch_bwd import run_backward


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, kw):
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse, meta, sink = run_forward(q, k, v, learnable_sink=learnable_sink, needs_grad=True, **kw)
        # the detached views are saved (they share the inputs' storage and version counter, so an in-place change
        # of an input still raises at the backward): the backward's launches read them without detaching again
        ctx.save_for_backward(q, k, v, out, lse, sink, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"],
                              kw["seqused_k"])
        ctx.meta = meta
        ctx.aux = kw.get("aux_tensors", ())  # read by the mods, never differentiated
        ctx.set_materialize_grads(False)  # an unused LSE gives dlse = None: no zeros to make, no subtraction
        ctx.sink_dtype = None if learnable_sink is None else learnable_sink.dtype
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        if dout is None:  # only the LSE is differentiated
            dout = torch.zeros_like(out)
        dq, dk, dv, dsink = run_backward(
            dout, q, k, v, out, lse, ctx.meta, sink=sink, dlse=dlse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            seqused_q=used_q, seqused_k=used_k, aux_tensors=ctx.aux, own_out=True,
        )
        if dsink is not None and ctx.sink_dtype is not None:
            dsink = dsink.to(ctx.sink_dtype)
        return dq, dk, dv, dsink, None
