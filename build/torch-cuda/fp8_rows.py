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


def dense_cu(batch, s, device):
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * s


def unpack(out, lse, batch, sq, dense_q, return_lse):
    """The kernel's (1, total_q, Hq, Dv) / (1, Hq, total_q) back to the caller's layout."""
    hq = out.shape[2]
    if not dense_q:
        return out[0], (lse[0] if return_lse else None)
    out = out.view(batch, sq, hq, out.shape[3])
    return out, (lse.view(hq, batch, sq).permute(1, 0, 2).contiguous() if return_lse else None)
