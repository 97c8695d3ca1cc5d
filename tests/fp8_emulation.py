"""FP8 attention emulated in fp32 torch, step for step as the FP8 forward computes it (kernels/fwd_fp8.py).

* S = q8 · k8ᵀ on the e4m3 values (products of e4m3 values are exact in fp32), times q_descale · k_descale ·
  softmax_scale (block descales: per (query block, key block)).
* ``softcap``: the kernel's form (kernels/fwd_fp8.py softcap_scores) in fp32, cap·log2e − 2·cap·log2e / (2^x + 1)
  with x = S · (2·log2e·softmax_scale / cap) · q_descale · k_descale; it differs from the kernel's ex2/rcp.approx by
  under ``softcap_tie_rel`` in P (the exact-input tests widen the tie band by that).
* Online softmax over key tiles of ``tile_n`` in the kernel's order, the running max over the scaled scores.
* P is exp2(s·log2e − (m − P_SHIFT_LOG2)) (at most 16: the kernel's fp32 argument, rounding included), rounded
  to e4m3 (saturating, round to nearest even); the row sum adds the unrounded fp32 P.
* ``return_slack``: also how far each output element can move if the P values that lie within ``TIE_REL`` of an
  e4m3 rounding midpoint round the other way.  The kernel's ex2.approx differs from torch's exp2 by a few fp32 ulps,
  so such a P may round to the neighbouring e4m3 value there: one step of 2^-3..2^-4 relative on one term, which
  moves the output by up to |v| / row_sum (0.11 on a row whose window holds two keys: the two failures of session
  31, benchmarks/experiments/fp8_window_probe.py).
* acc = acc · exp2(m_old − m_new) + P8 · v8, out = acc · v_descale · 2^−P_SHIFT_LOG2 / row_sum, then rounded to
  the output dtype; a learnable sink joins row_sum at the end, causal / window masks as FlashAttention's.

FlashAttention-3's accuracy input (section 4.3 of its paper): N(0, 1) entries with 0.1% of them drawn from
N(0, 10) instead (``fa3_outlier_inputs``).
"""

from __future__ import annotations

import math

import torch

P_SHIFT_LOG2 = 4  # P is scaled by 2^4 = 16 before the e4m3 conversion (the kernel's constant)
# a P within this relative distance of an e4m3 rounding midpoint may round either way on the GPU: 2^-18 is 32 fp32
# ulps, 8x the few ulps between ex2.approx.ftz.f32 (max relative error about 2^-22) and torch's exp2
TIE_REL = 2.0 ** -18


def fa3_outlier_inputs(b, sq, sk, hq, hkv, d, *, seed=0, outlier_frac=1e-3, outlier_std=10.0, dtype=torch.float32,
                       device="cpu"):
    """q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D): N(0, 1) with ``outlier_frac`` of the entries from N(0, 10)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def one(*shape):
        x = torch.randn(*shape, generator=g)
        pick = torch.rand(*shape, generator=g) < outlier_frac
        return torch.where(pick, torch.randn(*shape, generator=g) * outlier_std, x).to(dtype).to(device)

    return one(b, sq, hq, d), one(b, sk, hkv, d), one(b, sk, hkv, d)


def quantize_rows(q):
    """The FP8 kernel's quantization of a bf16/fp16 query (Fp8FwdConfig.q_dtype, kernels/fwd_fp8.py
    quantize_q_rows) in torch: q (..., D) -> (q8 e4m3 (..., D), descale fp32 (...)), one scale per row (a (query
    row, head) pair): scale = 448 / amax(|row|) in fp32 (0 for a row of zeros), q8 = e4m3(x * scale) saturated,
    descale = amax * fp32(1 / 448).  NaN in a row stays NaN in q8 (the amax skips it, as the kernel's fmax)."""
    x = q.float()
    amax = torch.nan_to_num(x, nan=0.0).abs().amax(dim=-1)
    scale = torch.where(amax > 0, torch.tensor(448.0) / amax, torch.zeros_like(amax))
    q8 = (x * scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q8, amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)


def _expand_descale(descale, s, hq, block_size):
    """(B, Hkv) or (B, Hkv, nblk) -> (B, Hq, S) fp32 per row."""
    b, hkv = descale.shape[:2]
    d = descale if descale.dim() == 3 else descale[..., None]
    d = d.repeat_interleave(hq // hkv, dim=1)
    if descale.dim() == 3:
        return d.repeat_interleave(block_size, dim=2)[..., :s]
    return d.expand(b, hq, s)


def emulate_fp8_attention(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None,
                          tile_n=64, right_to_left=True, block_size=128, out_dtype=torch.bfloat16,
                          quantize_p=True, window=(None, None), sink=None, return_slack=False, q_rows=False,
                          softcap=0.0, tie_rel=None):
    """Emulated FP8 forward -> out (B, Sq, Hq, Dv) in ``out_dtype``.  ``quantize_p=False`` keeps P in fp32 (to
    separate the error of P's rounding from that of the inputs').  ``return_slack=True`` -> (out, slack): slack
    (B, Sq, Hq, Dv) fp32 bounds the output's move from near-tie P roundings (module docstring).  ``q_rows=True``:
    q_descale is per row, (B, Sq, Hq) (``quantize_rows``, the kernel's bf16/fp16-query form).  ``softcap`` > 0:
    capped scores (module docstring); ``tie_rel``: the slack's tie band (default TIE_REL)."""
    b, sq, hq, d = q8.shape
    sk, hkv = k8.shape[1], k8.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q8.float().transpose(1, 2)  # (B, Hq, Sq, D)
    kf = k8.float().repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    vf = v8.float().repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    qd = (q_descale.float().transpose(1, 2) if q_rows
          else _expand_descale(q_descale.float(), sq, hq, block_size))  # (B, Hq, Sq)
    kd = _expand_descale(k_descale.float(), sk, hq, block_size)  # (B, Hq, Sk)
    vd = _expand_descale(v_descale.float(), 1, hq, block_size)[..., 0]  # (B, Hq)
    # the kernel's order: scale_log2 (rounded to fp32 on the host) times q_descale, times k_descale, times the score
    if softcap:  # the host's two fp32 arguments (dispatch_fp8.fp8_scales), then the kernel's tanh form
        pre = torch.tensor(2 * math.log2(math.e) * scale / softcap, dtype=torch.float32, device=q8.device)
        cap_log2 = torch.tensor(softcap * math.log2(math.e), dtype=torch.float32, device=q8.device)
        x = (qf @ kf.transpose(-1, -2)) * ((pre * qd)[..., :, None] * kd[..., None, :])
        s_all = cap_log2 - (cap_log2 + cap_log2) * (1.0 / (torch.exp2(x) + 1.0))
    else:
        scale_log2 = torch.tensor(scale * math.log2(math.e), dtype=torch.float32, device=q8.device)
        s_all = (qf @ kf.transpose(-1, -2)) * ((scale_log2 * qd)[..., :, None] * kd[..., None, :])
    tie = TIE_REL if tie_rel is None else tie_rel
    dev = q8.device
    left, right = (None if w is None or w < 0 else w for w in window)
    if causal:
        right = 0
    i = torch.arange(sq, device=dev)[:, None]
    j = torch.arange(sk, device=dev)[None, :]
    if right is not None:
        s_all = s_all.masked_fill(j > i + sk - sq + right, -math.inf)
    if left is not None:
        s_all = s_all.masked_fill(j < i + sk - sq - left, -math.inf)
    m = torch.full((b, hq, sq), -math.inf, device=dev)
    row_sum = torch.zeros(b, hq, sq, device=dev)
    acc = torch.zeros(b, hq, sq, vf.shape[-1], device=dev)
    slack = torch.zeros_like(acc)
    v_abs = vf.abs()
    starts = list(range(0, sk, tile_n))
    for n0 in (reversed(starts) if right_to_left else starts):
        s = s_all[..., n0:n0 + tile_n]
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)  # rows with no key yet
        p = torch.exp2(s - (m_use - P_SHIFT_LOG2)[..., None])  # 16·P, the kernel's fp32 argument
        corr = torch.exp2(m - m_use)
        row_sum = row_sum * corr + p.sum(dim=-1) * 2.0 ** -P_SHIFT_LOG2
        if quantize_p:
            up, down = (_e4m3(p * f) for f in (1.0 + tie, 1.0 - tie))
            slack = slack * corr[..., None] + (up - down) @ v_abs[..., n0:n0 + tile_n, :]
            p = _e4m3(p)
        acc = acc * corr[..., None] + p @ vf[..., n0:n0 + tile_n, :]
        m = m_new
    if sink is not None:  # one more logit in the denominator, in the same log2 units
        z = (sink.float().to(dev) * math.log2(math.e)).view(1, hq, 1).expand(b, hq, sq)
        m_fin = torch.where(z < m, m, z)
        empty = m_fin == -math.inf
        rescale = torch.where(empty, torch.zeros_like(m), torch.exp2(m - m_fin))
        row_sum = row_sum * rescale + torch.where(empty, torch.zeros_like(m), torch.exp2(z - m_fin))
        acc = acc * rescale[..., None]
        slack = slack * rescale[..., None]
    inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
    factor = (inv * vd[..., None] * 2.0 ** -P_SHIFT_LOG2)[..., None]
    out = (acc * factor).transpose(1, 2).to(out_dtype)
    if return_slack:
        return out, (slack * factor.abs()).transpose(1, 2)
    return out


def softcap_tie_rel(softcap: float) -> float:
    """The tie band of a softcap call: TIE_REL plus how far P can move from the kernel's tanh.  ex2.approx
    (relative error below 2^-22) and rcp.approx (1 ulp) give 2 / (2^x + 1) within 2^-21 relative, so tanh within
    2^-20 absolute (a 2x margin), the capped score (log2 units) within cap·log2e·2^-20, and P = exp2(score − m)
    within ln2 · cap · log2e · 2^-20 = cap · 2^-20 of it, relative."""
    return TIE_REL + softcap * 2.0 ** -20


def _e4m3(x):
    """Saturating round to nearest even e4m3, back in fp32."""
    return x.clamp(max=448.0).to(torch.float8_e4m3fn).float()


def rms(a, b) -> float:
    return float((a.float() - b.float()).pow(2).mean().sqrt())
