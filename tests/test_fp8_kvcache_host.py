"""An FP8 (e4m3) KV cache with a bf16/fp16 query, on the CPU (dispatch_fp8_varlen.fp8_kvcache_attention,
fp8_quant.quantize_query / quantize_with_descale): what reaches the (stubbed) launch, the quantized appends, and
every refusal.  The numbers on a GPU: tests/test_fp8_kvcache_gpu.py."""

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120.dispatch_fp8_varlen import fp8_kvcache_attention
from flash_attn_4_sm120.fp8_quant import quantize_query, quantize_query_packed, quantize_with_descale
from tests.test_fp8_varlen_host import launches  # noqa: F401  (the stubbed launch, a fixture)

E4 = torch.float8_e4m3fn
E4_REL = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round to nearest is within half an ulp, 2^-4 relative (normals)


def _randn(*shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _cache(b=2, s=16, hkv=2, d=64, seed=1):
    return (torch.randn(b, s, hkv, d, generator=torch.Generator().manual_seed(seed + i)).to(E4) for i in (0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv, sq", [(8, 2, 1), (4, 4, 3), (8, 1, 5)])
def test_a_bf16_query_reaches_the_kernel_as_is(launches, dtype, hq, hkv, sq):
    """The default output (q's dtype): the kernel quantizes q per tile row (Fp8FwdConfig.q_dtype), so the launch
    gets q itself as packed rows (a view, no torch kernel on the host) and no q descale."""
    b = 3
    q = _randn(b, sq, hq, 64, dtype=dtype)
    kc, vc = _cache(b, 16, hkv, 64)
    kd = torch.full((b, hkv), 0.25)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k_descale=kd, causal=True, return_softmax_lse=True)
    (c,) = launches
    assert c["q"].dtype == dtype and c["q"].data_ptr() == q.data_ptr() and c["q"].shape == (1, b * sq, hq, 64)
    assert torch.equal(c["q"][0], q.flatten(0, 1))
    qd, kd_got, vd_got = c["descales"]
    assert qd is None and torch.equal(kd_got, kd) and torch.equal(vd_got, torch.ones(b, hkv))
    assert c["out_dtype"] == dtype and out.dtype == dtype and out.shape == (b, sq, hq, 64)
    assert lse.shape == (b, hq, sq)


@pytest.mark.parametrize("make", ["odd_row_stride", "unaligned", "transposed", "size_one_seq"])
def test_a_query_the_kernel_cannot_read_in_place_is_copied_in_its_dtype(launches, make):
    q = {"odd_row_stride": _randn(2, 3, 8, 68)[..., :64],  # heads 136 bytes apart: not a multiple of 16
         "unaligned": _randn(2 * 3 * 8 * 64 + 1)[1:].view(2, 3, 8, 64),
         "transposed": _randn(2, 8, 3, 64).transpose(1, 2),
         # Sq = 1 with a sequence stride torch's is_contiguous ignores: batch stride != seqlen x row stride
         "size_one_seq": _randn(2, 8, 1, 64).transpose(1, 2)}[make]
    kc, vc = _cache(2, 16, 2, 64)
    fa.flash_attn_with_kvcache(q, kc, vc, causal=True)
    (c,) = launches
    got = c["q"]
    assert got.dtype == torch.bfloat16 and torch.equal(got[0], q.flatten(0, 1))
    assert got.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in got.stride()[:-1]) and got.stride(-1) == 1
    if make != "size_one_seq":
        assert got.data_ptr() != q.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv, sq", [(8, 2, 1), (4, 4, 3), (8, 1, 5)])
def test_a_bf16_query_is_quantized_per_kv_head_group(launches, dtype, hq, hkv, sq):
    """Another out_dtype than q's (flash_attn_varlen_func's out_dtype): the host quantizes q first (the kernel's
    bf16/fp16-query forms write q's dtype), one scale per (batch, KV head)."""
    b = 3
    # group g of batch entry i gets its own range, so one shared scale would be visibly wrong
    spread = torch.tensor([[0.01, 1.0, 30.0, 200.0][: hkv]] * b) * torch.tensor([1.0, 3.0, 0.5])[:, None]
    q = (_randn(b, sq, hq, 64, dtype=torch.float32).view(b, sq, hkv, hq // hkv, 64)
         * spread.view(b, 1, hkv, 1, 1)).view(b, sq, hq, 64).to(dtype)
    kc, vc = _cache(b, 16, hkv, 64)
    kd = torch.full((b, hkv), 0.25)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    # flash_attn_with_kvcache has no out_dtype (its output is q's dtype): the FP8 branch called directly
    out, lse = fp8_kvcache_attention(q, kc, vc, None, None, cache_seqlens=None, q_descale=None, k_descale=kd,
                                     v_descale=None, out_dtype=other, softmax_scale=None, causal=True,
                                     window_size=None, return_lse=True, learnable_sink=None, unsupported={})
    (c,) = launches
    q8, (qd, kd_got, vd_got) = c["q"], c["descales"]
    amax = q.float().view(b, sq, hkv, hq // hkv, 64).abs().amax(dim=(1, 3, 4))
    torch.testing.assert_close(qd, amax / 448, rtol=0, atol=0)
    assert torch.equal(kd_got, kd) and torch.equal(vd_got, torch.ones(b, hkv))  # the cache's, untouched
    assert q8.dtype == E4 and q8.shape == (1, b * sq, hq, 64) and q8.is_contiguous()
    back = (q8.float().view(b, sq, hkv, hq // hkv, 64) * qd.view(b, 1, hkv, 1, 1)).view(b, sq, hq, 64)
    normal = q.float().abs() >= 2.0 ** -6 * qd.repeat_interleave(hq // hkv, 1)[:, None, :, None]
    err = (back - q.float()).abs()
    assert (err[normal] <= E4_REL * q.float().abs()[normal]).all()
    assert q8.float().abs().max() == 448  # each group's amax lands on e4m3's largest value
    assert c["cu_q"].tolist() == [0, sq, 2 * sq, 3 * sq] and c["max_q"] == sq and c["causal"] is True
    assert c["out_dtype"] == other and out.dtype == other and out.shape == (b, sq, hq, 64)
    assert lse.shape == (b, hq, sq)


def test_zero_and_nan_groups():
    q = _randn(2, 2, 4, 64)
    q[0, :, 2:] = 0  # batch 0, KV head 1: all zero
    q[1, 1, 0, 5] = float("nan")  # batch 1, KV head 0: one NaN
    q8, qd = quantize_query(q, 2)
    assert qd[0, 1] == 1.0 and (q8[0, :, 2:].float() == 0).all()  # not 0 / 0
    assert torch.isnan(qd[1, 0]) and torch.isfinite(qd[[0, 0, 1]][:, [0, 1, 1]].diagonal()).all()
    assert not torch.isnan(q8[0].float()).any() and not torch.isnan(q8[1, :, 2:].float()).any()
    empty, qd0 = quantize_query(q[:, :0], 2)
    assert empty.shape == (2, 0, 4, 64) and torch.equal(qd0, torch.ones(2, 2))


def test_quantize_with_descale_saturates_and_keeps_nan():
    x = torch.tensor([1.0, -3.0, 1000.0, -1e6, 0.0, float("nan"), 17.0, 0.3]).view(1, 8, 1, 1).to(torch.bfloat16)
    got = quantize_with_descale(x, torch.tensor([[2.0]])).float().flatten()
    assert got[:5].tolist() == [0.5, -1.5, 448.0, -448.0, 0.0]  # past 448 saturates, never NaN
    assert torch.isnan(got[5])
    assert got[6] == 8.0 and abs(got[7] - 0.15) <= E4_REL * 0.15  # 8.5 ties to even (8); 0.15 rounds


@pytest.mark.parametrize("new_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, E4])
def test_bf16_appends_are_quantized_with_the_cache_descales(launches, new_dtype, q_dtype):
    b, hkv = 2, 2
    kc, vc = _cache(b + 1, 32, hkv, 64)  # one spare cache row
    before_k, before_v = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    q = _randn(b, 3, 4, 64, seed=5).to(q_dtype)
    k_new = _randn(b, 3, hkv, 64, seed=6, dtype=new_dtype, scale=3.0)
    v_new = _randn(b, 3, hkv, 64, seed=7, dtype=new_dtype)
    k_new[1, 2, 1, 0] = 5000.0  # saturates to 448 * descale
    kd = torch.tensor([[0.5, 0.125], [2.0, 0.03125]])
    vd = torch.tensor([[0.25, 1.0], [4.0, 0.0625]])
    seqlens = torch.tensor([4, 29], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
    (c,) = launches
    for cache, new, desc, before in ((kc, k_new, kd, before_k), (vc, v_new, vd, before_v)):
        untouched = torch.ones(b + 1, 32, dtype=torch.bool)
        for i, n in enumerate(seqlens.tolist()):
            stored = cache[i, n:n + 3].float() * desc[i].view(1, hkv, 1)  # the cache's value, dequantized
            x = new[i].float()
            sat = x.abs() >= 448 * desc[i].view(1, hkv, 1)
            assert torch.equal(stored[sat], (448 * desc[i].view(1, hkv, 1) * x.sign()).expand_as(x)[sat])
            small = x.abs() < 2.0 ** -6 * desc[i].view(1, hkv, 1)  # e4m3 subnormals: absolute error
            ok = (stored - x).abs() <= torch.where(small, 2.0 ** -10 * desc[i].view(1, hkv, 1), E4_REL * x.abs())
            assert (ok | sat).all(), (stored - x)[~sat].abs().max()
            untouched[i, n:n + 3] = False
        assert torch.equal(cache.view(torch.uint8)[untouched], before[untouched])
    assert c["used_k"].tolist() == [7, 32] and out.dtype == (q_dtype if q_dtype != E4 else torch.bfloat16)
    assert kc[1, 31, 1, 0].float() == 448.0


def test_the_e4m3_append_path_is_unchanged(launches):
    kc, vc = _cache(2, 16, 2, 64)
    k_new, v_new = (torch.randn(2, 1, 2, 64).to(E4) for _ in range(2))
    fa.flash_attn_with_kvcache(_randn(2, 1, 4, 64), kc, vc, k_new, v_new, cache_seqlens=3,
                               k_descale=torch.full((2, 2), 7.0))
    assert torch.equal(kc[:, 3].view(torch.uint8), k_new[:, 0].view(torch.uint8))  # bytes as given, not rescaled
    assert torch.equal(vc[:, 3].view(torch.uint8), v_new[:, 0].view(torch.uint8))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(q_descale=torch.ones(2, 2)), ValueError, "q_descale given with a torch.bfloat16 q"),
    (dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), NotImplementedError, "cache_batch_idx"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),  # softcap is served
    (dict(num_splits=2.0), ValueError, "num_splits must be an int"),
    (dict(k=_randn(2, 1, 2, 64), v=_randn(2, 1, 2, 64), cache_seqlens=1, num_splits=False), ValueError,
     "num_splits must be an int"),  # refused before the append writes the cache
    (dict(k_descale=torch.ones(2, 2, dtype=torch.bfloat16)), ValueError, "float32"),
    (dict(k_descale=torch.ones(1, 2)), ValueError, r"\(2, 2\)"),
    (dict(k=_randn(2, 1, 2, 64, dtype=torch.float32), v=_randn(2, 1, 2, 64, dtype=torch.float32),
          cache_seqlens=1), ValueError, "bfloat16/float16 \\(quantized here"),
    (dict(k=_randn(2, 1, 2, 64), v=_randn(2, 1, 2, 32), cache_seqlens=1), ValueError, "head dim of v_cache"),
    (dict(k=_randn(2, 1, 2, 64), v=_randn(2, 1, 2, 64), cache_seqlens=16), ValueError, "does not fit"),
])
def test_refusals_with_a_bf16_query(launches, kw, exc, match):
    kc, vc = _cache(2, 16, 2, 64)
    before = kc.view(torch.uint8).clone()
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(_randn(2, 1, 4, 64), kc, vc, **kw)
    assert not launches and torch.equal(kc.view(torch.uint8), before)  # refused before any write


def test_mixed_caches_other_query_dtypes_grad_and_other_entry_points_raise(launches):
    kc, vc = _cache(2, 16, 2, 64)
    q = _randn(2, 1, 4, 64)
    with pytest.raises(ValueError, match="v is torch.bfloat16"):  # an e4m3 K cache beside a bf16 V cache
        fa.flash_attn_with_kvcache(q, kc, vc.float().bfloat16())
    with pytest.raises(ValueError, match="q is torch.float32"):
        fa.flash_attn_with_kvcache(q.float(), kc, vc)
    with pytest.raises(ValueError, match="inference-only"):
        fa.flash_attn_with_kvcache(q.clone().requires_grad_(), kc, vc)
    with pytest.raises(ValueError, match="bf16/fp16 query"):  # dense: quantize with fp8_quant.quantize_qkv
        fa.flash_attn_func(q, kc, vc)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_descale given with"):
        fa.flash_attn_varlen_func(q[:, 0], kc.flatten(0, 1), vc.flatten(0, 1), cu_seqlens_q=cu,
                                  cu_seqlens_k=cu * 16, q_descale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="packed \\(total, heads, head_dim\\) rows"):
        fa.flash_attn_varlen_func(q, kc.flatten(0, 1), vc.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu * 16)
    assert not launches


def test_packed_query_scales_are_per_sequence():
    lens = [7, 0, 4, 1]
    q = _randn(4, 7, 8, 64, seed=9) * torch.tensor([1.0, 5.0, 0.01, 300.0]).view(4, 1, 1, 1).bfloat16()
    cu = torch.tensor([0, 7, 7, 11, 12], dtype=torch.int32)
    tail = _randn(3, 8, 64, seed=10) * 1000  # rows past cu_seqlens_q[-1]: their own scale, never the last sequence's
    packed = torch.cat([q[i, :n] for i, n in enumerate(lens)] + [tail])
    q8, qd = quantize_query_packed(packed, 2, cu)
    assert q8.shape == packed.shape and qd.shape == (4, 2) and torch.equal(qd[1], torch.ones(2))  # empty: 1.0
    for i, n in enumerate(lens):
        if n:
            one8, one_d = quantize_query(q[i:i + 1, :n], 2)  # the dense rule, sequence by sequence
            assert torch.equal(qd[i], one_d[0])
            assert torch.equal(q8[cu[i]:cu[i] + n].view(torch.uint8), one8[0].view(torch.uint8))
    packed[8, 6, 1] = float("nan")  # sequence 2, KV head 1 (heads 4..7)
    _, qd = quantize_query_packed(packed, 2, cu)
    assert torch.isnan(qd[2, 1]) and torch.isfinite(qd[[0, 2, 3], [0, 0, 0]]).all() and torch.isfinite(qd[3]).all()


@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("in_kernel", [True, False])
def test_varlen_with_a_bf16_query(launches, varlen_q, in_kernel):
    cu_k = torch.tensor([0, 5, 21], dtype=torch.int32)
    k, v = (torch.randn(21, 2, 64).to(E4) for _ in range(2))
    q = _randn(2, 3, 8, 64, seed=11, dtype=torch.float16)
    kw = dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=3) if varlen_q else {}
    out_dtype = torch.float16 if in_kernel else torch.bfloat16
    out, _ = fa.flash_attn_varlen_func(q.flatten(0, 1) if varlen_q else q, k, v, cu_seqlens_k=cu_k, causal=True,
                                       v_descale=torch.full((2, 2), 0.5), out_dtype=out_dtype, **kw)
    (c,) = launches
    assert torch.equal(c["descales"][2], torch.full((2, 2), 0.5))
    if in_kernel:  # q's own dtype out: the kernel quantizes each row
        assert c["q"].dtype == torch.float16 and torch.equal(c["q"][0], q.flatten(0, 1))
        assert c["descales"][0] is None
    else:  # the host fallback, per (sequence, KV head)
        q8_ref, qd_ref = quantize_query(q, 2)
        assert c["q"].dtype == E4 and torch.equal(c["q"].view(torch.uint8).flatten(),
                                                  q8_ref.view(torch.uint8).flatten())
        assert torch.equal(c["descales"][0], qd_ref)
    assert out.dtype == out_dtype and out.shape == ((6,) if varlen_q else (2, 3)) + (8, 64)


def test_without_the_stub_a_bf16_query_reaches_the_device_check():
    kc, vc = _cache(2, 16, 2, 64)
    with pytest.raises(ValueError, match="CUDA tensors"):  # every host check passed: CPU tensors stop here
        fa.flash_attn_with_kvcache(_randn(2, 1, 4, 64), kc, vc)
