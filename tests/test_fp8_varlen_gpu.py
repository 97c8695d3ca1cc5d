"""FP8 (e4m3) varlen and KV-cache calls on a GPU (kernels/fwd_fp8.py's varlen form, dispatch_fp8_varlen.py).

Each sequence is checked on its own, with the bars of tests/test_fp8_gpu.py: on e4m3-exact inputs against the
step-by-step emulation (P's rounding only, with the emulation's slack for near-tie P values) and the LSE against
the fp32 reference; on FlashAttention-3's outlier input the RMS error against the fp32 reference of the
UNquantized inputs at most 1.1x the emulation's.  The emulation models the unsplit kernel, so the exact
comparisons pin ``num_splits=1`` (the default may split these small grids: tests/test_fp8_split_gpu.py checks the
split against the unsplit call); the outlier test keeps the default and allows a split's P rounding (twice the RMS
that P's rounding puts into the emulation, as tests/test_fp8_split_gpu.py derives).
"""

import pytest
import torch

from flash_attn_4_sm120.fp8_quant import quantize_qkv
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, rms
from tests.reference import attention_ref
from tests.test_fp8_gpu import _check_exact, _check_key_split

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

E4 = torch.float8_e4m3fn


def _exact(*shape, g):
    return torch.randn(*shape, device="cuda", generator=g).to(E4)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (True, (1, 5)),
                                            (False, (100, 30))])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("lens_q, lens_k", [([1, 130, 0, 64], [200, 70, 5, 64]), ([300, 17], [300, 1000])])
def test_packed_rows_match_each_sequence(d, causal, window, with_sink, lens_q, lens_k):
    g = torch.Generator(device="cuda").manual_seed(d + sum(lens_q))
    hq, hkv = 6, 2
    q8 = _exact(sum(lens_q), hq, d, g=g)
    k8, v8 = _exact(sum(lens_k), hkv, d, g=g), _exact(sum(lens_k), hkv, d, g=g)
    sink = (torch.randn(hq, device="cuda", generator=g) * 3).float() if with_sink else None
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = fa.flash_attn_varlen_func(q8, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                         causal=causal, window_size=window, learnable_sink=sink, return_lse=True,
                                         num_splits=1)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    _check_each_sequence(out, lse, q8, k8, v8, lens_q, lens_k, causal=causal, window=window, sink=sink)


def _check_each_sequence(out, lse, q8, k8, v8, lens_q, lens_k, **kw):
    """Each non-empty sequence of a varlen call against _check_exact (bf16 output) on its own rows and keys."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        rows = slice(q0, q0 + lq)
        _check_exact(out[rows][None], lse[:, rows][None], q8[rows][None], k8[k0:k0 + lk][None],
                     v8[k0:k0 + lk][None], torch.bfloat16, **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (100, 30))])
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_softcap_packed_rows_match_each_sequence(d, causal, window, pack_gqa):
    """Softcap (cap 4 on q times 3) over packed rows, with a sink: each sequence against the capped emulation
    (_check_exact's bars; P's rounding and the kernel's tanh form only)."""
    g = torch.Generator(device="cuda").manual_seed(d + 3)
    lens_q, lens_k, hq, hkv = [1, 130, 0, 64], [200, 70, 5, 64], 6, 2
    q8 = (3 * torch.randn(sum(lens_q), hq, d, device="cuda", generator=g)).to(E4)
    k8, v8 = _exact(sum(lens_k), hkv, d, g=g), _exact(sum(lens_k), hkv, d, g=g)
    sink = torch.linspace(-2, 2, hq, device="cuda")
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = fa.flash_attn_varlen_func(q8, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                         causal=causal, window_size=window, learnable_sink=sink, return_lse=True,
                                         num_splits=1, softcap=4.0, pack_gqa=pack_gqa)
    _check_each_sequence(out, lse, q8, k8, v8, lens_q, lens_k, causal=causal, window=window, sink=sink, softcap=4.0)


def test_seqused_k_caps_the_keys_and_empty_sequences_are_zero():
    g = torch.Generator(device="cuda").manual_seed(7)
    q8, k8, v8 = _exact(3, 40, 4, 64, g=g), _exact(3, 96, 2, 64, g=g), _exact(3, 96, 2, 64, g=g)
    used = torch.tensor([96, 33, 0], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q8, k8, v8, seqused_k=used, causal=True, return_lse=True, num_splits=1)
    assert out.shape == (3, 40, 4, 64) and lse.shape == (3, 4, 40)
    for b, n in enumerate((96, 33)):
        _check_exact(out[b:b + 1], lse[b:b + 1], q8[b:b + 1], k8[b:b + 1, :n], v8[b:b + 1, :n], torch.bfloat16,
                     causal=True)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


@pytest.mark.parametrize("rotate", [False, True])
def test_outlier_input_error_matches_the_emulation_per_sequence(rotate):
    lens_q, lens_k = [700, 1, 513], [700, 900, 1500]
    (q, k, v) = fa3_outlier_inputs(3, 1500, 1500, 4, 2, 128, seed=11, device="cuda")
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, rotate=rotate)  # (B, Hkv) descales: one per sequence
    pack = lambda x, lens: torch.cat([x[b, :n] for b, n in enumerate(lens)])  # noqa: E731
    out, _ = fa.flash_attn_varlen_func(pack(q8, lens_q), pack(k8, lens_k), pack(v8, lens_k), cu_seqlens_q=_cu(lens_q),
                                       cu_seqlens_k=_cu(lens_k), max_seqlen_q=700, q_descale=qd, k_descale=kd,
                                       v_descale=vd, causal=True)
    cu_q = _cu(lens_q)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sl = lambda x, n: x[b:b + 1, :n]  # noqa: E731
        ref, _ = attention_ref(sl(q, lq), sl(k, lk), sl(v, lk), causal=True)
        emu_args = (sl(q8, lq), sl(k8, lk), sl(v8, lk), qd[b:b + 1], kd[b:b + 1], vd[b:b + 1])
        emu = emulate_fp8_attention(*emu_args, causal=True)
        p_rms = rms(*(emulate_fp8_attention(*emu_args, causal=True, quantize_p=p, out_dtype=torch.float32)
                      for p in (True, False)))
        got = out[int(cu_q[b]):int(cu_q[b]) + lq][None]
        err, err_emu = rms(got, ref), rms(emu, ref)
        assert err <= 1.1 * err_emu, (b, err, err_emu)
        assert rms(got, emu) <= 0.2 * err_emu + 2 * p_rms, (b, rms(got, emu), err_emu, p_rms)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_append_then_attend(d, causal):
    g = torch.Generator(device="cuda").manual_seed(d)
    b, cap, hq, hkv, s_new = 3, 300, 8, 2, 4
    k_cache, v_cache = _exact(b + 1, cap, hkv, d, g=g), _exact(b + 1, cap, hkv, d, g=g)
    spare = k_cache[b].clone()
    q8, k_new, v_new = _exact(b, s_new, hq, d, g=g), _exact(b, s_new, hkv, d, g=g), _exact(b, s_new, hkv, d, g=g)
    seqlens = torch.tensor([0, 17, 290], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_with_kvcache(q8, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                                         return_softmax_lse=True, num_splits=1)
    assert out.shape == (b, s_new, hq, d) and lse.shape == (b, hq, s_new)
    assert torch.equal(k_cache[b].view(torch.uint8), spare.view(torch.uint8))  # the spare row is not written
    for i, n in enumerate(seqlens.tolist()):
        assert torch.equal(k_cache[i, n:n + s_new].view(torch.uint8), k_new[i].view(torch.uint8))
        assert torch.equal(v_cache[i, n:n + s_new].view(torch.uint8), v_new[i].view(torch.uint8))
        # 4 queries x 4 heads per KV head = 16 packed rows: the key-split decode tile
        _check_key_split(out[i:i + 1], lse[i:i + 1], q8[i:i + 1], k_cache[i:i + 1, :n + s_new],
                         v_cache[i:i + 1, :n + s_new], torch.bfloat16, causal=causal)


def test_kvcache_decode_descales_and_graph_replay():
    g = torch.Generator(device="cuda").manual_seed(3)
    k_cache, v_cache = _exact(2, 512, 2, 128, g=g), _exact(2, 512, 2, 128, g=g)
    q8 = _exact(2, 1, 8, 128, g=g)
    seqlens = torch.tensor([100, 400], dtype=torch.int32, device="cuda")
    kd = torch.full((2, 2), 0.5, device="cuda")
    ones = torch.ones(2, 2, device="cuda")
    eager, lse = fa.flash_attn_with_kvcache(q8, k_cache, v_cache, cache_seqlens=seqlens, k_descale=ones,
                                           return_softmax_lse=True, num_splits=1)
    for i, n in enumerate((100, 400)):
        _check_key_split(eager[i:i + 1], lse[i:i + 1], q8[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n],
                         torch.bfloat16)  # 4 packed rows: the key-split decode tile
    # k_descale acts on the scores: 0.5 is the same call with half the softmax scale
    eager = fa.flash_attn_with_kvcache(q8, k_cache, v_cache, cache_seqlens=seqlens, k_descale=kd)
    torch.testing.assert_close(eager, fa.flash_attn_with_kvcache(q8, k_cache, v_cache, cache_seqlens=seqlens,
                                                                 softmax_scale=0.5 / 128 ** 0.5), rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.flash_attn_with_kvcache(q8, k_cache, v_cache, cache_seqlens=seqlens, k_descale=kd)
    seqlens.copy_(torch.tensor([400, 100]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fa.flash_attn_with_kvcache(q8, k_cache, v_cache, cache_seqlens=seqlens,
                                                               k_descale=kd), rtol=0, atol=0)
