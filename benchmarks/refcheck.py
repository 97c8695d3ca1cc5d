"""Correctness checks for the maintained benchmarks, computed in plain torch independently of every kernel timed
(ours and the peers): attention forward and backward, in fp32 (the ground truth) and in the inputs' dtype (the
yardstick), chunked over query rows so that a 16K-token cell needs no S x S matrix.

The bar is the tests' (tests/reference.py): max |x - ref_fp32| <= 2 * max |same_dtype - ref_fp32| + atol.  A result
that fails it is an error row in the benchmark's results, never a timing.

Layouts: q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), as flash_attn_func; causal is bottom-right
aligned (query i sees key j <= i + Sk - Sq).
"""

from __future__ import annotations

import math

import torch

ROWS_PER_CHUNK = 1024


def _scores(qc, k, i0, sq, causal, scale):
    """Scaled fp32 scores of query rows i0 ... i0 + len(qc) - 1 against every key, causal mask applied:
    qc (rows, G, D), k (Sk, D) -> (G, rows, Sk)."""
    s = torch.einsum("rgd,kd->grk", qc, k).float() * scale
    if causal:
        sk = k.shape[0]
        i = torch.arange(i0, i0 + qc.shape[0], device=qc.device)[:, None]
        j = torch.arange(sk, device=qc.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    return s


def forward(q, k, v, causal: bool, dtype=torch.float32, softmax_scale=None):
    """Attention output (B, Sq, Hq, Dv) computed in ``dtype`` (fp32: scores, softmax and P V in fp32; bf16/fp16:
    the products in that dtype and P rounded to it, the softmax in fp32, as PyTorch in the inputs' dtype)."""
    b, sq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(b, sq, hq, dv, dtype=dtype, device=q.device)
    for bi in range(b):
        for h in range(hkv):
            kk, vv = k[bi, :, h].to(dtype), v[bi, :, h].to(dtype)
            for i0 in range(0, sq, ROWS_PER_CHUNK):
                qc = q[bi, i0:i0 + ROWS_PER_CHUNK, h * g:(h + 1) * g].to(dtype)
                p = torch.softmax(_scores(qc, kk, i0, sq, causal, scale), dim=-1).nan_to_num(0.0)
                out[bi, i0:i0 + qc.shape[0], h * g:(h + 1) * g] = torch.einsum("grk,kd->rgd", p.to(dtype), vv)
    return out


def backward_one_group(q, k, v, dout, causal: bool, batch: int, kv_head: int, dtype=torch.float32,
                       softmax_scale=None):
    """(dq, dk, dv) of one batch entry and one KV head (its Hq / Hkv query heads), in ``dtype`` as ``forward``:
    dq (Sq, G, D), dk (Sk, D), dv (Sk, Dv).  P = softmax(S), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O),
    dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q, row chunk by row chunk."""
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv = k.shape[2]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    heads = slice(kv_head * g, (kv_head + 1) * g)
    kk, vv = k[batch, :, kv_head].to(dtype), v[batch, :, kv_head].to(dtype)
    dq = torch.empty(sq, g, d, dtype=dtype, device=q.device)
    dk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
    dvv = torch.zeros(vv.shape, dtype=torch.float32, device=q.device)
    for i0 in range(0, sq, ROWS_PER_CHUNK):
        qc = q[batch, i0:i0 + ROWS_PER_CHUNK, heads].to(dtype)
        doc = dout[batch, i0:i0 + ROWS_PER_CHUNK, heads].to(dtype)
        p = torch.softmax(_scores(qc, kk, i0, sq, causal, scale), dim=-1).nan_to_num(0.0)  # (G, rows, Sk) fp32
        pd = p.to(dtype)
        o = torch.einsum("grk,kd->rgd", pd, vv)
        dvv += torch.einsum("grk,rgd->kd", pd, doc).float()
        dp = torch.einsum("rgd,kd->grk", doc, vv).float()
        delta = (doc.float() * o.float()).sum(-1).transpose(0, 1)[..., None]  # (G, rows, 1)
        ds = (p * (dp - delta)).to(dtype)
        dq[i0:i0 + qc.shape[0]] = torch.einsum("grk,kd->rgd", ds, kk) * scale
        dk += torch.einsum("grk,rgd->kd", ds, qc).float() * scale
    return dq, dk.to(dtype), dvv.to(dtype)


def check(name: str, got, ref, same_dtype) -> tuple[float | None, float, str | None]:
    """(max error of ``got`` against the fp32 ``ref``, the bar, None or a message when it fails the bar)."""
    ref, same_dtype = ref.float(), same_dtype.float()
    err_dtype = (same_dtype - ref).abs().max().item()
    atol = 1e-3 * ref.abs().max().item() + 1e-6  # relative: decode outputs over 32K keys are ~1e-2
    bar = 2 * err_dtype + atol
    if got is None:
        return None, bar, f"{name}: no result"
    got = got.float()
    if not torch.isfinite(got).all():
        return None, bar, f"{name}: non-finite values"
    err = (got - ref).abs().max().item()
    if err <= bar:
        return err, bar, None
    return err, bar, f"{name}: max error {err:.3e} > bar {bar:.3e} (2 x {err_dtype:.3e} + {atol:.1e})"
