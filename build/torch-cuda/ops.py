"""torch.library registration, so ``torch.compile(fullgraph=True)`` sees the attention as two opaque ops
(forward and backward) with fake implementations and autograd, instead of tracing into CuTe-DSL.

The namespace is this package's module name (``flash_attn_4_sm120``, or the ``_flash_attn_4_sm120_cuda_<hash>``
id a ``kernels`` build is loaded under), so two builds in one process never collide.  Registering the ops is the
only thing this package does at import: torch.compile must find them before it traces a model, and
registration touches neither CUDA nor CuTe-DSL.
"""

from __future__ import annotations

import torch

from .dispatch import forward_meta, run_backward, run_forward

NS = __name__.rsplit(".", 1)[0].lstrip(".").replace(".", "_")


def _lse_shape(q: torch.Tensor, varlen_q: bool):
    return (q.shape[1], q.shape[0]) if varlen_q else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op(f"{NS}::fwd", mutates_args=())
def fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
    softmax_scale: float | None, causal: bool, window_left: int | None, window_right: int | None, softcap: float,
    pack_gqa: bool | None, debug_checks: bool | None, page_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _, _ = run_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), learnable_sink=sink, softcap=softcap, pack_gqa=pack_gqa,
        needs_grad=page_table is None,  # paged K/V is inference-only (the caller refused grad-requiring inputs)
        debug_checks=debug_checks, page_table=page_table,
    )
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
              softmax_scale, causal, window_left, window_right, softcap, pack_gqa, debug_checks, page_table=None):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{NS}::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, sink: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None, softmax_scale: float | None, causal: bool,
    window_left: int | None, window_right: int | None, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = forward_meta(q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                        softcap=softcap)
    sink32 = None if sink is None else sink.detach().float().contiguous()
    dq, dk, dv, dsink = run_backward(
        dout, q, k, v, out, lse, meta, sink=sink32, dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k,
    )
    if dsink is None:
        dsink = q.new_zeros((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap):
    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


_SAVED_ARGS = ("sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
_STATIC_ARGS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right", "softcap")


def _setup_context(ctx, inputs, output):
    args = dict(zip(("q", "k", "v", "sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                     "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right",
                     "softcap", "pack_gqa", "debug_checks", "page_table"), inputs))
    out, lse = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, *(args[n] for n in _SAVED_ARGS))
    ctx.static = {n: args[n] for n in _STATIC_ARGS}
    ctx.sink_dtype = None if args["sink"] is None else args["sink"].dtype


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv, dsink = bwd(dout, dlse, q, k, v, out, lse, sink, cu_q, cu_k, used_q, used_k, **ctx.static)
    dsink = None if ctx.sink_dtype is None else dsink.to(ctx.sink_dtype)
    return dq, dk, dv, dsink, None, None, None, None, None, None, None, None, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
