"""Host dispatch: the forward launch sequence behind every entry point (the public functions, autograd and the
torch.library ops all call ``run_forward``, and ``dispatch_bwd.run_backward`` for gradients; none of them imports
another).

A call reaches here after ``compat.check_call`` (interface.py) refused any conflicting features.  Then, once each:
validation of the tensors and host values (validate.py), the plan (plan.py: the key, the memoised kernel configs of
config_plan.py, the per-call decode / split / packing choices), and the launch.

No device->host synchronisation: dense calls never read device memory on the host, and varlen calls do not when
``max_seqlen_q/k`` are given (FlashAttention's API asks for them).  When one is missing it is computed on the
device and read once (one sync), and under CUDA-graph capture it is required.  ``cu_seqlens``/``seqused``
values are the caller's contract, as in FlashAttention; the kernels clamp every row they touch to the tensors
they were given, so a lie gives wrong numbers but never an out-of-bounds access.  ``FA4_SM120_DEBUG_CHECKS=1``
(read once, at the first varlen call) or ``debug_checks=True`` checks those values on the host and names the lie
(validate.debug_checks_enabled).
"""

from __future__ import annotations

import math

import torch

from . import block_sparse as BS
from . import dropout as D
from . import plan as P
from . import splitkv as SK
from . import validate as V
from .arguments import FWD_ARGS
from .config import MAX_SEQLEN
from .device import device_caps
from .launch import compiled_kernel as _kernel, detached, launch as _launch


def run_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                learnable_sink=None, softcap=0.0, pack_gqa=None, needs_grad=False, debug_checks=None,
                page_table=None, num_splits=1, block_sparse_tensors=None, block_sparse_tensors_bwd=None,
                dropout_p=0.0, dropout_seed=None, dropout_offset=None, mods=None, aux_tensors=(),
                deterministic=False):
    """Validate, plan, then run the forward kernel.  Returns (out, lse, meta, sink_fp32).  With ``needs_grad`` the
    backward configuration is validated too, before anything launches.  ``page_table``: paged K/V (inference
    only: with ``needs_grad`` or dropout it raises).  ``num_splits``: split-KV (splitkv.py; 1 = none, <= 0 =
    automatic).  ``block_sparse_tensors``: see block_sparse.py (one split); with ``needs_grad`` the block sizes for
    the backward and ``block_sparse_tensors_bwd`` (the KV-major lists, optional) are checked here and kept in the
    meta.  ``mods``/``aux_tensors``: the checked modspec.ModSpec and aux tuple of a call with score/mask mods
    (modspec.check_mods).

    Dropout (dropout.py states the RNG contract): 0 < p < 1 runs the kernels compiled with dropout; p = 0 the
    kernels without it; p = 1 the kernels without it, then O = 0 (the LSE is that of the undropped scores, and
    the backward gives only the LSE's gradient).  With score/mask mods the mods act on the scores, dropout on P after
    the softmax.  Conflicting features (dropout with split-KV, block sparsity or pages; pages with grad; ...) were
    refused by compat.check_call before this runs."""
    p_drop = float(dropout_p)  # checked by the caller (interface._check_common, or the op's fake at trace time)
    sparse = block_sparse_tensors is not None
    sink, values = V.check_forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, learnable_sink=learnable_sink, debug_checks=debug_checks,
        page_table=page_table)
    dev = q.device
    caps = device_caps(dev)  # UnsupportedDeviceError (naming the device) before anything compiles
    varlen_q, paged = cu_seqlens_q is not None, page_table is not None
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv = k.shape[-2], v.shape[-1]
    _, softcap_v, _, _, windowed, batch, max_q, max_k = values
    drop = None
    if p_drop > 0.0:
        drop = D.resolve(p_drop, dropout_seed, dropout_offset, dev)
    elif dropout_seed is not None or dropout_offset is not None:
        D.check_seed(dropout_seed, dropout_offset, dev)  # a wrong type raises even when p = 0
    in_kernel = drop is not None and drop.p < 1.0
    ratios, sparse_lists, sparse_grad = (0, 0), None, None
    if sparse:
        ratios, sparse_lists = BS.check_block_sparse(
            block_sparse_tensors, batch=batch, heads=hq, max_q=max_q, max_k=max_k, head_dim=d, head_dim_v=dv,
            windowed=windowed, device=dev, debug=V.debug_checks_enabled(debug_checks), tma=caps.tma)
        # the plan key carries the block size: it picks the tile (config.select_sparse_tile)
        ratios = (*ratios, *(getattr(block_sparse_tensors, "block_size", None) or BS.DEFAULT_BLOCK_SIZE))
        if needs_grad:
            sparse_grad = BS.prepare_backward(
                block_sparse_tensors, block_sparse_tensors_bwd, sparse_lists, batch=batch, heads=hq, max_q=max_q,
                max_k=max_k, head_dim=d, head_dim_v=dv, windowed=windowed, device=dev,
                debug=V.debug_checks_enabled(debug_checks), mods=mods,
                call=dict(dtype=V.DTYPE_NAMES[q.dtype], tma=caps.tma, has_softcap=softcap_v > 0, varlen_q=varlen_q,
                          varlen_k=cu_seqlens_k is not None, seqused_q=seqused_q is not None,
                          seqused_k=seqused_k is not None))
    key = P.PlanKey(V.DTYPE_NAMES[q.dtype], d, dv, windowed, softcap_v > 0, sink is not None, varlen_q,
                    cu_seqlens_k is not None, seqused_q is not None, seqused_k is not None, needs_grad, dev.index,
                    paged, False, ratios, 0, P.sparse_bwd_key(sparse_grad), in_kernel,
                    in_kernel and drop.seed_tensor is not None, False, in_kernel and drop.high_p, mods,
                    paged and P.paged_eligible_for_tma(k, v, d, dv, windowed, mods, caps.tma), caps.tma)
    # with needs_grad the meta carries the backward's plan key, so the backward looks it up instead of rebuilding it
    meta = P.FwdMeta(*values, sparse=sparse_grad, dropout=drop, mods=mods, deterministic=deterministic,
                     plan_key=P.backward_key(key) if needs_grad else None)
    plan = P.get_plan(key)
    out = q.new_empty((*q.shape[:-1], dv))
    lse = torch.empty((hq, q.shape[0]) if varlen_q else (batch, hq, q.shape[1]), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse, meta, sink
    if max_q == 0 or max_k == 0:  # nothing to attend to anywhere: O = 0, LSE = -inf (or the sink logit)
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink[:, None].expand_as(lse) if varlen_q else sink[None, :, None].expand_as(lse))
        return out, lse, meta, sink
    ratio = hq // hkv
    plan, pack, splits, num_m_blocks = P.launch_plan(
        key, plan, pack_gqa=pack_gqa, ratio=ratio, heads=hq, batch=batch, max_q=max_q, max_k=max_k,
        num_splits=num_splits, device=dev, caps=caps)
    o_dst, lse_dst = out, lse
    if splits > 1:  # fp32 partials with a leading split dim (one allocation), combined below
        o_dst, lse_dst, o_comb, lse_comb = SK.partials(out, lse, splits, varlen_q)
    if plan.fwd_fn is None:
        plan.fwd_fn = _kernel(plan.fwd_cfg, dev)
    scale_log2, prescale = meta.log2_scales()
    _launch(plan.fwd_fn, FWD_ARGS, dev, dict(
        q=detached(q), k=detached(k), v=detached(v), out=o_dst, lse=lse_dst, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, sink=sink,
        sparse=sparse_lists, aux_tensors=aux_tensors or None, scale_log2=scale_log2, softcap_prescale=prescale,
        window_left=meta.left, window_right=meta.right, pack=pack, qheads_per_kvhead=ratio,
        num_m_blocks=num_m_blocks, num_head_groups=hq // pack, num_batch=batch * splits,
        dropout=drop.kernel_params() if in_kernel else None,
    ))
    if splits > 1:
        SK.combine_into(o_comb, lse_comb, out, lse, varlen_q)
    if drop is not None and not in_kernel:  # p = 1: every probability dropped
        out.zero_()
    return out, lse, meta, sink


__all__ = ["run_forward", "MAX_SEQLEN"]
