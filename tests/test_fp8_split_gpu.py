"""Packed GQA and split-KV of the FP8 forward on a GPU (kernels/fwd_fp8.py ``pack_gqa`` / ``split``; the host in
dispatch_fp8.run_fp8_packed), through flash_attn_with_kvcache (a bf16 query over an e4m3 cache), flash_attn_func
and flash_attn_varlen_func.

Bars, derived rather than chosen:
  * packing changes which CTA computes a row, never its arithmetic (the same Q bytes, the same K/V tiles in the same
    order; the extra tiles a packed CTA visits are fully masked for the row, which adds exact zeros and rescales by
    exp2(0) = 1), so a packed call equals the unpacked one bit for bit, out and LSE, on the 64-row tile, which
    Sq = 5 / 40 take here.  Sq = 1 takes the decode tile (config_fp8.FP8_DECODE_TILE_M, 4 or 8 packed rows), whose
    key-split warps (kv_warps) each round P against their own running max before the merge, as a split does: that
    call is held to the split's bar below (out and LSE);
  * a split rounds P to e4m3 against its own running max instead of the whole row's, so a split call differs from
    the unsplit one by P's rounding only: at most twice the RMS that P's rounding alone puts into the emulated output
    (tests/fp8_emulation.py, quantize_p True vs False, on the same quantized inputs; emulated splits move it
    0.49-0.57 of that, benchmarks/results/fp8_split_emulation_cpu.jsonl from
    benchmarks/experiments/fp8_split_emulation.py), plus the output dtype's
    rounding (2^-8 of the output's RMS for bf16); the LSE sums unrounded fp32 P, so it matches the unsplit LSE to
    the fp32 approximations' level (ex2/lg2.approx: 1e-4 absolute on LSEs of a few units).
A split that dropped or repeated a range of keys, a wrong head in a packed row or a sink in every split moves the
output by the size of the attention output itself, far past these bars.
"""

import math

import pytest
import torch

from flash_attn_4_sm120.config_fp8 import FP8_DECODE_TILE_M
from flash_attn_4_sm120.fp8_quant import quantize_qkv
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, quantize_rows, rms

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

E4 = torch.float8_e4m3fn
LSE_ATOL = 1e-4


def _cache(b, cap, hq, hkv, sq, d=128, seed=0):
    q, k, v = fa3_outlier_inputs(b, sq, cap, hq, hkv, d, seed=seed, device="cuda", dtype=torch.bfloat16)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    return q, k8, v8, kd, vd


def _p_rounding_rms(q, k8, v8, kd, vd, lens, **mask):
    """RMS that rounding P to e4m3 puts into the emulated output, over the batch entries (each its own length); the
    query quantized per (row, head) as the kernel does with a bf16 q (tests/fp8_emulation.quantize_rows)."""
    q8, qd = quantize_rows(q)
    diffs = []
    for i, n in enumerate(lens):
        sl = slice(i, i + 1)
        args = (q8[sl], k8[sl, :n], v8[sl, :n], qd[sl], kd[sl], vd[sl])
        a = emulate_fp8_attention(*args, quantize_p=True, out_dtype=torch.float32, q_rows=True, **mask)
        b = emulate_fp8_attention(*args, quantize_p=False, out_dtype=torch.float32, q_rows=True, **mask)
        diffs.append((a - b).pow(2).mean())
    return float(torch.stack(diffs).mean().sqrt())


def _kv(q, kc, vc, kd, vd, seqlens, **kw):
    return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                      return_softmax_lse=True, **kw)


MASKS = [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(300, None)),
         dict(causal=False, window_size=(200, 40))]


@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1), (4, 4)])
@pytest.mark.parametrize("sq", [1, 5, 40])
@pytest.mark.parametrize("mask", range(len(MASKS)))
@pytest.mark.parametrize("with_sink", [False, True])
def test_packed_gqa_is_bitwise_the_unpacked_kernel(hq, hkv, sq, mask, with_sink):
    b, cap = 3, 1000
    q, kc, vc, kd, vd = _cache(b, cap, hq, hkv, sq, seed=hq + sq + mask)
    seqlens = torch.tensor([cap, 333, sq], dtype=torch.int32, device="cuda")
    sink = torch.linspace(-1, 4, hq, device="cuda") if with_sink else None
    kw = dict(MASKS[mask], learnable_sink=sink, num_splits=1)
    out_u, lse_u = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=False, **kw)
    out_p, lse_p = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=True, **kw)
    assert not torch.isnan(out_u).any()
    assert rms(out_u, torch.zeros_like(out_u)) > 0.01  # a real output, not an empty one
    if hq > hkv and sq * (hq // hkv) <= FP8_DECODE_TILE_M:  # the key-split decode tile: P rounded per warp
        window = MASKS[mask].get("window_size", (None, None))
        p_rms = _p_rounding_rms(q, kc, vc, kd, vd, seqlens.tolist(), causal=MASKS[mask]["causal"], window=window,
                                sink=sink)
        assert not torch.isnan(out_p).any()
        assert rms(out_p, out_u) <= 2 * p_rms + 2.0 ** -8 * rms(out_u, torch.zeros_like(out_u)), p_rms
        torch.testing.assert_close(lse_p, lse_u, rtol=0, atol=LSE_ATOL)
    else:
        torch.testing.assert_close(out_p, out_u, rtol=0, atol=0)
        torch.testing.assert_close(lse_p, lse_u, rtol=0, atol=0)


@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1), (4, 4)])
@pytest.mark.parametrize("sq", [1, 6])
@pytest.mark.parametrize("splits", [2, 7])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("mask", range(len(MASKS)))
@pytest.mark.parametrize("with_sink", [False, True])
def test_split_matches_unsplit_within_p_rounding(hq, hkv, sq, splits, pack, mask, with_sink):
    b, cap = 3, 1500
    q, kc, vc, kd, vd = _cache(b, cap, hq, hkv, sq, seed=3 * hq + sq + mask)
    lens = [cap, 777, 70]  # 24, 13 and 2 KV tiles: splits of several tiles, of one, and empty ones
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sink = torch.linspace(-1, 4, hq, device="cuda") if with_sink else None
    kw = dict(MASKS[mask], learnable_sink=sink, pack_gqa=pack)
    out_1, lse_1 = _kv(q, kc, vc, kd, vd, seqlens, num_splits=1, **kw)
    out_n, lse_n = _kv(q, kc, vc, kd, vd, seqlens, num_splits=splits, **kw)
    window = MASKS[mask].get("window_size", (None, None))
    p_rms = _p_rounding_rms(q, kc, vc, kd, vd, lens, causal=MASKS[mask]["causal"], window=window, sink=sink)
    bar = 2 * p_rms + 2.0 ** -8 * rms(out_1, torch.zeros_like(out_1))
    assert not torch.isnan(out_n).any()
    assert rms(out_n, out_1) <= bar, (rms(out_n, out_1), p_rms)
    torch.testing.assert_close(lse_n, lse_1, rtol=0, atol=LSE_ATOL)


@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1)])
@pytest.mark.parametrize("sq", [1, 6])
@pytest.mark.parametrize("mask", range(len(MASKS)))
@pytest.mark.parametrize("with_sink", [False, True])
def test_softcap_packed_is_bitwise_and_split_within_p_rounding(hq, hkv, sq, mask, with_sink):
    """Softcap is per score, so packing and splitting keep their bars: packed = unpacked bit for bit (within the split's
    P-rounding bar on the key-split decode tile, which rounds P per warp, as without softcap), a split
    within twice P's rounding RMS (of the capped emulation) of the unsplit call, the LSEs to LSE_ATOL."""
    b, cap, softcap = 3, 1500, 5.0
    q, kc, vc, kd, vd = _cache(b, cap, hq, hkv, sq, seed=5 * hq + sq + mask)
    q = 3 * q  # scores of a few units: cap 5 bends them
    lens = [cap, 777, 70]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sink = torch.linspace(-1, 4, hq, device="cuda") if with_sink else None
    kw = dict(MASKS[mask], learnable_sink=sink, softcap=softcap)
    out_u, lse_u = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=False, num_splits=1, **kw)
    out_p, lse_p = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=True, num_splits=1, **kw)
    assert not torch.isnan(out_u).any()
    window = MASKS[mask].get("window_size", (None, None))
    p_rms = _p_rounding_rms(q, kc, vc, kd, vd, lens, causal=MASKS[mask]["causal"], window=window, sink=sink,
                            softcap=softcap)
    bar = 2 * p_rms + 2.0 ** -8 * rms(out_u, torch.zeros_like(out_u))
    if hq > hkv and sq * (hq // hkv) <= FP8_DECODE_TILE_M:  # the key-split decode tile: P rounded per warp
        assert not torch.isnan(out_p).any()
        assert rms(out_p, out_u) <= bar, (rms(out_p, out_u), p_rms)
        torch.testing.assert_close(lse_p, lse_u, rtol=0, atol=LSE_ATOL)
    else:
        torch.testing.assert_close(out_p, out_u, rtol=0, atol=0)
        torch.testing.assert_close(lse_p, lse_u, rtol=0, atol=0)
    out_n, lse_n = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=True, num_splits=7, **kw)
    assert rms(out_n, out_u) <= bar, (rms(out_n, out_u), p_rms)
    torch.testing.assert_close(lse_n, lse_u, rtol=0, atol=LSE_ATOL)
    uncapped, _ = _kv(q, kc, vc, kd, vd, seqlens, pack_gqa=True, num_splits=1, **MASKS[mask], learnable_sink=sink)
    assert rms(uncapped, out_p) > 10 * bar  # the cap changed the result, far past the split's bar


def test_dense_fp8_call_packs_and_splits_like_the_unsplit_kernel():
    b, sq, sk, hq, hkv = 2, 3, 2100, 16, 2
    q, k, v = fa3_outlier_inputs(b, sq, sk, hq, hkv, 128, seed=11, device="cuda")
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    args = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True, return_lse=True)
    out_1, lse_1 = fa.flash_attn_func(q8, k8, v8, pack_gqa=False, num_splits=1, **args)  # the dense kernel
    out_p, lse_p = fa.flash_attn_func(q8, k8, v8, pack_gqa=True, num_splits=1, **args)  # packed rows
    torch.testing.assert_close(out_p, out_1, rtol=0, atol=0)
    torch.testing.assert_close(lse_p, lse_1, rtol=0, atol=0)
    out_n, lse_n = fa.flash_attn_func(q8, k8, v8, num_splits=5, **args)
    diffs = [emulate_fp8_attention(q8, k8, v8, qd, kd, vd, causal=True, quantize_p=p, out_dtype=torch.float32)
             for p in (True, False)]
    bar = 2 * rms(*diffs) + 2.0 ** -8 * rms(out_1, torch.zeros_like(out_1))
    assert rms(out_n, out_1) <= bar
    torch.testing.assert_close(lse_n, lse_1, rtol=0, atol=LSE_ATOL)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
def test_varlen_split_with_empty_sequences_and_uncovered_rows(pack, with_sink):
    lens_q, lens_k = [1, 0, 3, 2], [900, 200, 0, 1300]
    hq, hkv = 8, 2
    total_q = sum(lens_q) + 2  # two rows past cu_seqlens_q[-1]: in no sequence
    qs = torch.randn(total_q, hq, 128, device="cuda").to(E4)
    k8 = torch.randn(sum(lens_k), hkv, 128, device="cuda").to(E4)
    v8 = torch.randn(sum(lens_k), hkv, 128, device="cuda").to(E4)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    sink = torch.linspace(-2, 2, hq, device="cuda") if with_sink else None
    args = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=3, max_seqlen_k=1300, causal=True,
                return_lse=True, learnable_sink=sink, pack_gqa=pack)
    out_1, lse_1 = fa.flash_attn_varlen_func(qs, k8, v8, num_splits=1, **args)
    out_n, lse_n = fa.flash_attn_varlen_func(qs, k8, v8, num_splits=6, **args)
    used = sum(lens_q)
    # sequence 2 has no keys: O = 0 and LSE = -inf (or the sink's logit) in both
    rows2 = slice(1, 4)
    assert (out_n[rows2] == 0).all()
    expect = sink.view(hq, 1).expand(hq, 3) if with_sink else torch.full((hq, 3), -math.inf, device="cuda")
    torch.testing.assert_close(lse_n[:, rows2], expect, rtol=0, atol=LSE_ATOL)
    # rows in no sequence combine to O = 0 and LSE = -inf
    assert (out_n[used:] == 0).all() and (lse_n[:, used:] == -math.inf).all()
    # the rows with keys: e4m3-exact inputs with unit descales, so only P's rounding separates the split
    q4 = qs[:used].float()
    bar_parts = []
    for s0, n, k0, nk in ((0, 1, 0, 900), (4, 2, 1100, 1300)):
        one = lambda t, a, m: t[a:a + m].unsqueeze(0)  # noqa: E731
        emu = [emulate_fp8_attention(one(q4, s0, n).to(E4), one(k8, k0, nk), one(v8, k0, nk),
                                     torch.ones(1, hkv, device="cuda"), torch.ones(1, hkv, device="cuda"),
                                     torch.ones(1, hkv, device="cuda"), causal=True, sink=sink, quantize_p=p,
                                     out_dtype=torch.float32) for p in (True, False)]
        bar_parts.append(rms(*emu))
        rows = slice(s0, s0 + n)
        bar = 2 * bar_parts[-1] + 2.0 ** -8 * rms(out_1[rows], torch.zeros_like(out_1[rows]))
        assert rms(out_n[rows], out_1[rows]) <= bar
        torch.testing.assert_close(lse_n[:, rows], lse_1[:, rows], rtol=0, atol=LSE_ATOL)


def test_split_decode_under_cuda_graph_replay():
    b, cap, hq, hkv = 2, 4096, 32, 8
    q, kc, vc, kd, vd = _cache(b, cap, hq, hkv, 1, seed=5)
    static_q = q.clone()
    seqlens = torch.tensor([1000, 3000], dtype=torch.int32, device="cuda")

    def step():
        return fa.flash_attn_with_kvcache(static_q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                          num_splits=4, pack_gqa=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    static_q.copy_(torch.flip(q, dims=(0,)))
    seqlens.copy_(torch.tensor([1001, 4096]))
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
