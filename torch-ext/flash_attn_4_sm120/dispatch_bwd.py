"""Host dispatch of the backward: the one backward path (``run_backward``) behind autograd and the torch.library
ops, and the preprocess launch (``bwd_dpsum``).  The backward's kernel configs live in the same memoised plan
(plan.py) as the forward's, under the forward's key with ``needs_grad``.  No device->host synchronisation.
"""

from __future__ import annotations

import math

import torch

from . import block_sparse as BS
from . import plan as P
from . import validate as V

from .arguments import BWD_DKDV_ARGS, BWD_DQ_ARGS, BWD_PRE_ARGS, DQ_CONVERT_ARGS
from .config_bwd import BwdPreKernelConfig, dq_accum_blocks, dq_turns_offset, fused_for
from .device import device_caps
from .launch import compiled_kernel as _kernel, detached, launch as _launch


def _row_valid(lse, cu_q, used_q):
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


# (dtype, head_dim_v, has_dlse, device index) -> the compiled preprocess kernel (keyed on the values its
# BwdPreKernelConfig holds, so a call builds no config once its kernel is known)
_PRE_KERNELS: dict[tuple, object] = {}


def fused_plan(plan: P.Plan, device: torch.device, relay: bool = False):
    """The fused backward (config_bwd.fused_for) of ``plan``'s dK/dV configuration: (fused config, convert config,
    compiled fused kernel, compiled convert kernel), memoised in the plan (a plan is per device); None where the
    kernel pair runs it, or on a device without vector reductions.  ``relay``: its deterministic form (config
    ``dq_relay``), memoised beside it."""
    fused = plan.relay if relay else plan.fused
    if fused is False:
        cfgs = fused_for(plan.bwd_cfg, relay) if device_caps(device).red_f32x2 else None
        fused = None if cfgs is None else (*cfgs, _kernel(cfgs[0], device), _kernel(cfgs[1], device))
        if relay:
            plan.relay = fused
        else:
            plan.fused = fused
    return fused


def dq_workspace(fcfg, batch: int, rows_q: int, hq: int, varlen_q: bool, device):
    """(dq_accum, dq_turns) of a fused call: the fp32 dQ workspace (tiles, Hq, tile_m * D) and, for the relay form,
    its int32 turn counters (tiles, Hq) (None otherwise), zeroed by one memset of one allocation (the counters
    after the workspace, 16-byte aligned: config_bwd.dq_turns_offset)."""
    blocks = dq_accum_blocks(fcfg.tile_m, batch, rows_q, varlen_q)
    elems = blocks * hq * fcfg.tile_m * fcfg.head_dim
    if not fcfg.dq_relay:
        return torch.zeros((blocks, hq, fcfg.tile_m * fcfg.head_dim), dtype=torch.float32, device=device), None
    start = dq_turns_offset(elems)
    buf = torch.zeros(start + blocks * hq, dtype=torch.float32, device=device)
    accum = buf[:elems].view(blocks, hq, fcfg.tile_m * fcfg.head_dim)
    return accum, buf[start:].view(torch.int32).view(blocks, hq)


def clear_caches() -> None:
    """Forget the compiled preprocess and fused kernels (harnesses that replace the compiler call this before and
    after, so no stand-in outlives them); the fused kernels live in the plans, which go too."""
    _PRE_KERNELS.clear()
    P.clear()


# rows (batch * heads * seqlen) one preprocess launch covers: the kernel indexes rows in int32, with room for the
# last CTA's rows past the end
PRE_MAX_ROWS = (1 << 31) - (1 << 16)


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its last dim is contiguous and its rows are 16-byte aligned (what the kernels' vector loads
    need), else a contiguous copy."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
        return t.contiguous()
    return t


def bwd_dpsum(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, varlen_q: bool) -> torch.Tensor:
    """D = rowsum(dO * O) - dLSE in fp32 (kernels/bwd_preprocess.py), in the LSE layout: (B, Hq, Sq), or
    (Hq, total_q) when ``varlen_q``; contiguous.  dout/out: the output's layout, last dim contiguous, rows 16-byte
    aligned; dlse: anything that broadcasts to the LSE's shape (read in place, strides 0 included).  Every row
    present in the tensors is computed; no device->host sync; no launch when there are no rows."""
    if varlen_q:
        dpsum = torch.empty((out.shape[1], out.shape[0]), dtype=torch.float32, device=out.device)
        out4, dout4, d3 = out.unsqueeze(0), dout.unsqueeze(0), dpsum.unsqueeze(0)  # batch 1
    else:
        dpsum = torch.empty((out.shape[0], out.shape[2], out.shape[1]), dtype=torch.float32, device=out.device)
        out4, dout4, d3 = out, dout, dpsum
    if dpsum.numel() == 0:
        return dpsum
    dlse3 = None
    if dlse is not None:
        dlse = dlse.to(torch.float32).expand_as(dpsum)
        dlse3 = dlse.unsqueeze(0) if varlen_q else dlse
    dev = out.device
    pre_key = (out.dtype, out.shape[-1], dlse is not None, dev.index)
    fn = _PRE_KERNELS.get(pre_key)
    if fn is None:
        cfg = BwdPreKernelConfig(V.DTYPE_NAMES[out.dtype], out.shape[-1], dlse is not None)
        fn = _PRE_KERNELS[pre_key] = _kernel(cfg, dev)
    if dpsum.numel() <= PRE_MAX_ROWS:
        _launch(fn, BWD_PRE_ARGS, dev, dict(dout=dout4, out=out4, dpsum=d3, dlse=dlse3, num_rows=dpsum.numel()))
        return dpsum
    b, s, h = out4.shape[:3]  # more rows than int32 indexes: launches over batch / sequence chunks
    bstep = max(1, PRE_MAX_ROWS // (s * h))
    sstep = s if s * h <= PRE_MAX_ROWS else PRE_MAX_ROWS // h
    for b0 in range(0, b, bstep):
        for s0 in range(0, s, sstep):
            bs, ss = slice(b0, b0 + bstep), slice(s0, s0 + sstep)
            d_chunk = d3[bs, :, ss]
            _launch(fn, BWD_PRE_ARGS, dev, dict(
                dout=dout4[bs, ss], out=out4[bs, ss], dpsum=d_chunk,
                dlse=None if dlse3 is None else dlse3[bs, :, ss], num_rows=d_chunk.numel()))
    return dpsum


def run_backward(dout, q, k, v, out, lse, meta: P.FwdMeta, *, sink=None, dlse=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, seqused_q=None, seqused_k=None, aux_tensors=(), own_out=False):
    """Gradients (dq, dk, dv, dsink) of the forward described by ``meta``.

    After the preprocess kernel (kernels/bwd_preprocess.py: D = rowsum(dO * O) in fp32, minus dLSE when the
    caller differentiates through the returned LSE), by default the fused kernel (kernels/bwd_dkdv.py with
    ``fused_dq``: dK, dV and dQ from one pass, dQ added into a zeroed fp32 workspace) and the dQ convert kernel;
    with ``meta.deterministic`` the same kernel's relay form (``dq_relay``: the adds of each query tile in key-tile
    order, kernels/dq_relay.py), bitwise reproducible.  With a learnable sink, block sparsity or a feature set no
    fused tile takes: two atomic-free kernels (kernels/bwd_dkdv.py, kernels/bwd_dq.py), bitwise reproducible
    (block-sparse calls too: ``meta.sparse`` holds their lists).  Host-side piece, O(tokens): the learnable-sink gradient, closed-form:
    d sink_h = -sum_i exp(sink_h - lse_i) D_i over valid rows, with D_i = sum_j P_ij dP_ij in fp32 from the dQ
    kernel.

    ``own_out`` (autograd.FlashAttnFunction): ``out`` is the forward's own output (allocated contiguous, in q's
    dtype, on q's device) and autograd's engine gave ``dout`` out's shape, dtype and device, so of the checks below
    only dout's row alignment can fail; the torch.library op, whose tensors come from the compiler, checks all."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    dev = q.device
    if dout.stride(-1) != 1 or dout.data_ptr() % 16:
        dout = dout.contiguous()
    if not own_out:
        V.check_tensor("dout", dout, out.dim(), dev)
        if dout.shape != out.shape:
            raise ValueError(f"dout has shape {tuple(dout.shape)}, the output {tuple(out.shape)}")
        out = _rows16(out)  # read by the preprocess kernel with 16-byte vectors
        V.check_tensor("out", out, dout.dim(), dev)
        if dout.dtype != out.dtype:
            raise ValueError(f"dout has dtype {dout.dtype}, the output {out.dtype}; pass dout in the output's dtype")
    elif math.gcd(*dout.stride()[:-1]) % 8 and dout.numel():  # rows not 16-byte aligned: check_tensor names it
        V.check_tensor("dout", dout, out.dim(), dev)
    drop = meta.dropout
    if drop is not None and drop.p >= 1.0:  # O = 0 whatever P is: only the LSE's gradient flows (dP = 0, D = -dLSE)
        dout = torch.zeros_like(dout)
        drop = None
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv_dim = k.shape[-2], v.shape[-1]
    # D in the LSE layout, (Hq, total_q) or (B, Hq, Sq), in fp32 (dO and O rounded to 16 bits would bias dS)
    dpsum = bwd_dpsum(dout, out, dlse, varlen_q)
    # rows outside every sequence are written by no kernel: zero them first (dense inputs cover every row)
    partial = varlen_q or varlen_k or seqused_q is not None or seqused_k is not None
    alloc = torch.zeros_like if partial else torch.empty_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    # sum_j P dP per row, in fp32, from the dQ kernel: the sink gradient's D (DqKernelConfig.sink_grad)
    pdpsum = alloc(lse) if sink is not None else None
    if meta.max_q > 0 and meta.max_k > 0 and q.numel() and k.numel():
        sg = meta.sparse
        key = meta.plan_key  # the forward's key (plan.backward_key), or None: built here
        if key is None:
            fwd_ratios = (0, 0)
            if sg is not None:  # the forward's plan key (its ratios to the forward tile, and the block size)
                fwd_ratios = (*BS.block_size_ratios(sg.fwd_block_size, d, dv_dim, meta.windowed),
                              *sg.fwd_block_size)
            key = P.PlanKey(
                V.DTYPE_NAMES[q.dtype], d, dv_dim, meta.windowed, meta.softcap > 0, sink is not None, varlen_q,
                varlen_k, seqused_q is not None, seqused_k is not None, True, dev.index, sparse=fwd_ratios,
                sparse_bwd=meta.sparse_bwd_key(), dropout=drop is not None,
                seed_tensor=drop is not None and drop.seed_tensor is not None, mods=meta.mods,
                tma=device_caps(dev).tma)  # the forward's plan: its key without the per-call overrides
        plan = P.get_plan(key)
        fused = None
        if sink is None:  # deterministic=True: the relay form, its dQ adds in a fixed order
            fused = fused_plan(plan, dev, meta.deterministic)
        if plan.bwd_fn is None and fused is None:
            plan.bwd_fn, plan.dq_fn = _kernel(plan.bwd_cfg, dev), _kernel(plan.dq_cfg, dev)
        scale_log2, prescale = meta.log2_scales()
        common = dict(q=detached(q), k=detached(k), v=detached(v), dout=detached(dout), lse=lse, dpsum=dpsum,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                      seqused_k=seqused_k, aux_tensors=aux_tensors or None, scale_log2=scale_log2,
                      softcap_prescale=prescale, softmax_scale=meta.scale, window_left=meta.left,
                      window_right=meta.right, qheads_per_kvhead=hq // hkv, num_batch=meta.batch,
                      dropout=None if drop is None else drop.kernel_params())
        # block sparsity: the dK/dV kernel walks the KV-major lists (built here, on the device, when the caller
        # gave none), the dQ kernel the forward's
        sparse_dkdv = None if sg is None else sg.backward_tensors()
        if fused is not None:
            fcfg, _, fused_fn, cvt_fn = fused
            rows_q = q.shape[0] if varlen_q else q.shape[1]
            dq_accum, dq_turns = dq_workspace(fcfg, meta.batch, rows_q, hq, varlen_q, dev)
            _launch(fused_fn, BWD_DKDV_ARGS, dev, dict(
                common, sparse=sparse_dkdv, dk=dk, dv=dv, dq_accum=dq_accum, dq_turns=dq_turns,
                num_n_blocks=-(-meta.max_k // fcfg.tile_n), num_kv_heads=hkv))
            _launch(cvt_fn, DQ_CONVERT_ARGS, dev, dict(
                dq_accum=dq_accum, dq=dq, cu_seqlens_q=cu_seqlens_q, seqused_q=seqused_q, softmax_scale=meta.scale,
                num_m_blocks=-(-meta.max_q // fcfg.tile_m), num_heads=hq, num_batch=meta.batch))
            return dq, dk, dv, None
        _launch(plan.bwd_fn, BWD_DKDV_ARGS, dev, dict(
            common, sparse=sparse_dkdv, dk=dk, dv=dv, dq_accum=None, dq_turns=None,
            num_n_blocks=-(-meta.max_k // plan.bwd_cfg.tile_n), num_kv_heads=hkv))
        _launch(plan.dq_fn, BWD_DQ_ARGS, dev, dict(
            common, sparse=None if sg is None else sg.fwd_tensors, dq=dq, pdpsum=pdpsum,
            num_m_blocks=-(-meta.max_q // plan.dq_cfg.tile_m), num_heads=hq))
    elif not partial:
        dq.zero_(), dk.zero_(), dv.zero_()
        if pdpsum is not None:
            pdpsum.zero_()
    dsink = None
    if sink is not None:
        d_exact = pdpsum - dlse if dlse is not None else pdpsum
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
        p_sink = torch.exp(sink.view(-1, 1) - lse_safe) if varlen_q else torch.exp(sink.view(1, -1, 1) - lse_safe)
        contrib = p_sink * d_exact
        valid = _row_valid(lse, cu_seqlens_q, seqused_q)
        if valid is not None:
            contrib = torch.where(valid, contrib, torch.zeros_like(contrib))
        dsink = -(contrib.sum(-1) if varlen_q else contrib.sum((0, 2)))
    return dq, dk, dv, dsink



__all__ = ["PRE_MAX_ROWS", "bwd_dpsum", "run_backward"]
