"""Packed-rows views of the FP8 forward's dense tensors (host only): the kernel's varlen form reads q/k/v as
(1, total, H, D) rows with int32 cu_seqlens; dense (B, S, H, D) tensors become that form as views, and the outputs
go back to the caller's layout.  Shared by dispatch_fp8 (dense calls that pack GQA or split) and
dispatch_fp8_varlen (varlen and KV-cache calls)."""

from __future__ import annotations

import torch


def flatten(t, name):
    """(B, S, H, D) -> (1, B * S, H, D) view, without a copy (a cache is never copied)."""
    b, s = t.shape[:2]
    if b > 1 and s > 0 and t.stride(0) != s * t.stride(1):
        raise ValueError(f"{name} (strides {t.stride()}) cannot be read as packed rows: its batch stride must be "
                         f"seqlen x its row stride ({s} x {t.stride(1)}); use .contiguous()")
    return t.as_strided((1, b * s) + tuple(t.shape[2:]), (b * s * t.stride(1) or 1,) + t.stride()[1:],
                        t.storage_offset())


def flatten_q(q):
    """A dense q as packed rows: a view, or a copy of q (never of K/V) when its layout does not allow one."""
    ok = q.shape[0] <= 1 or q.shape[1] == 0 or q.stride(0) == q.shape[1] * q.stride(1)
    return flatten(q if ok else q.contiguous(), "q")


# Small read-only device tensors that every FP8 call on dense or KV-cache inputs would otherwise rebuild with one
# or two torch kernels each (cu_seqlens 0, s, 2s, ...; per-sequence lengths; descales of 1.0): six such kernels
# sat in front of each FP8-cache decode step, about 8 us of a 53 us step (Nsight Compute, B=8 KV 8K:
# benchmarks/experiments/results/fp8_decode_ncu_h200_s41.jsonl).  Kept per (device, stream, what, sizes): a tensor
# made on one stream is used only behind the kernel that wrote it.  Never evicted, so a CUDA graph that captured one
# keeps reading live memory; a tensor asked for under capture is not kept (its memory is the graph's and is written
# only on replay).  Bounded: past _CONST_MAX entries new ones are made per call, as before.
_CONST: dict = {}
_CONST_MAX = 4096


def _device_constant(what, sizes, device, make):
    device = torch.device(device)
    if device.type != "cuda":
        return make(device)
    if device.index is None:  # "cuda": the current device, named so the key does not follow a later switch
        device = torch.device("cuda", torch.cuda.current_device())
    key = (what, sizes, device.index, torch.cuda.current_stream(device).cuda_stream)
    t = _CONST.get(key)
    if t is None:  # the capture state is asked on a miss only (a host query)
        t = make(device)
        if len(_CONST) < _CONST_MAX and not torch.cuda.is_current_stream_capturing():
            _CONST[key] = t
    return t


def dense_cu(batch, s, device):
    """(batch + 1,) int32 offsets 0, s, 2s, ... of a dense (batch, s) side read as packed rows (read-only)."""
    return _device_constant("cu", (batch, s), device,
                            lambda dev: torch.arange(batch + 1, dtype=torch.int32, device=dev) * s)


def uniform_lengths(batch, s, device):
    """(batch,) int32 of s: every sequence's length when a dense side has no per-sequence lengths (read-only)."""
    return _device_constant("len", (batch, s), device,
                            lambda dev: torch.full((batch,), s, dtype=torch.int32, device=dev))


def unit_descale(b, hkv, device):
    """(b, hkv) fp32 ones: a descale the caller left out (FlashAttention-3: 1.0), read-only."""
    return _device_constant("one", (b, hkv), device,
                            lambda dev: torch.ones(b, hkv, dtype=torch.float32, device=dev))


def unpack(out, lse, batch, sq, dense_q, return_lse):
    """The kernel's (1, total_q, Hq, Dv) / (1, Hq, total_q) back to the caller's layout."""
    hq = out.shape[2]
    if not dense_q:
        return out[0], (lse[0] if return_lse else None)
    out = out.view(batch, sq, hq, out.shape[3])
    return out, (lse.view(hq, batch, sq).permute(1, 0, 2).contiguous() if return_lse else None)
