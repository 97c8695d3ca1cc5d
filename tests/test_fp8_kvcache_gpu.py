"""An FP8 (e4m3) KV cache with a bf16/fp16 query on a GPU (flash_attn_with_kvcache, and flash_attn_varlen_func's
packed rows; dispatch_fp8_varlen.py).

Inputs: FlashAttention-3's outlier distribution (tests/fp8_emulation.fa3_outlier_inputs) in the query's dtype; the
cache holds K/V quantized per (batch, KV head) (fp8_quant.quantize_qkv's descales), the appended keys come in as
bf16/fp16 and are quantized on the way in.  Bars, as tests/test_fp8_gpu.py derives them (measured:
benchmarks/results/fp8_accuracy_cpu.jsonl): the RMS error against the fp32 reference of the UNquantized q/k/v is at
most 1.1x that of the step-by-step emulation (tests/fp8_emulation.py) of the same quantized inputs, and the kernel
differs from the emulation by at most a fifth of that error (the emulation's own error on decode shapes, 1.5-2.0e-2
with the kernel's per-row query scales, 1.8-2.4e-2 with one per (batch, KV head), is in
benchmarks/results/fp8_kvcache_accuracy_cpu.jsonl, from benchmarks/experiments/fp8_kvcache_accuracy.py).
Each batch entry (its own cache length) is checked on its own.  The kernel quantizes a bf16/fp16 query itself,
one scale per (query row, head) (Fp8FwdConfig.q_dtype): the emulation takes the same rule
(tests/fp8_emulation.quantize_rows).  Beside the bars, exact identities: the appended cache rows are the bytes of
x / descale rounded to e4m3; a query row of zeros scores every key 0 (LSE = log(keys), O = the mean of V); NaN in
a query row stays in that row; and a varlen call whose out_dtype differs from q's (the host's per-(sequence, KV
head) quantization, ``fp8_quant.quantize_query_packed``) gives bitwise the e4m3 path on that q8 and q_descale.
"""

import math

import pytest
import torch

from flash_attn_4_sm120.fp8_quant import quantize_qkv, quantize_query_packed
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, quantize_rows, rms
from tests.reference import attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

E4 = torch.float8_e4m3fn


def _setup(b, cap, hq, hkv, sq, d=128, seed=0, dtype=torch.bfloat16):
    """q (B, Sq, Hq, D), full-length k/v (B, cap, Hkv, D) in ``dtype`` and their e4m3 cache (B + 1 rows: a spare
    that must stay untouched) with (B, Hkv) descales over the whole of k/v (so appends never saturate)."""
    q, k, v = fa3_outlier_inputs(b, sq, cap, hq, hkv, d, seed=seed, device="cuda", dtype=dtype)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    spare = torch.randn(1, cap, hkv, d, device="cuda").to(E4)
    return q, k, v, torch.cat([k8, spare]), torch.cat([v8, spare.clone()]), kd, vd


def _check(out, q, k, v, k8, v8, kd, vd, lens, causal=False, window=(None, None), sink=None, softcap=0.0):
    """The bars per batch entry.  These calls take the default, which packs GQA and may split the keys
    (tests/test_fp8_split_gpu.py): the emulation models the unsplit kernel, and a split rounds P against its own
    running max, so the kernel-emulation bar adds twice the RMS that P's rounding puts into the emulation (the
    split's bar there; emulated splits measured 0.49-0.57 of it: benchmarks/results/fp8_split_emulation_cpu.jsonl)."""
    qs8, qd = quantize_rows(q)  # the kernel's per-(row, head) quantization of a bf16/fp16 q
    for i, n in enumerate(lens):
        sl = slice(i, i + 1)
        ref, _ = attention_ref(q[sl], k[sl, :n], v[sl, :n], causal=causal, window=window, sink=sink, softcap=softcap)
        args = (qs8[sl], k8[sl, :n], v8[sl, :n], qd[sl], kd[sl], vd[sl])
        mask = dict(causal=causal, window=window, sink=sink, q_rows=True, softcap=softcap)
        emu = emulate_fp8_attention(*args, **mask, out_dtype=q.dtype)
        p_rms = rms(*(emulate_fp8_attention(*args, **mask, quantize_p=p, out_dtype=torch.float32)
                      for p in (True, False)))
        err, err_emu = rms(out[sl], ref), rms(emu, ref)
        assert not torch.isnan(out[sl]).any()
        assert err <= 1.1 * err_emu, (i, err, err_emu)
        assert rms(out[sl], emu) <= 0.2 * err_emu + 2 * p_rms, (i, rms(out[sl], emu), err_emu, p_rms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1), (4, 4)])
@pytest.mark.parametrize("sq", [1, 6])
@pytest.mark.parametrize("causal", [False, True])
def test_append_then_attend_against_the_unquantized_reference(dtype, hq, hkv, sq, causal):
    b, cap = 3, 1100
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, sq, seed=hq + sq, dtype=dtype)
    spare = kc[b].view(torch.uint8).clone()
    seqlens = torch.tensor([0, 517, cap - sq], dtype=torch.int32, device="cuda")
    k_new = torch.stack([k[i, n:n + sq] for i, n in enumerate(seqlens.tolist())])
    v_new = torch.stack([v[i, n:n + sq] for i, n in enumerate(seqlens.tolist())])
    _, k8_all, v8_all, _, _, _ = quantize_qkv(q, k, v)  # what the append must store, byte for byte
    for i, n in enumerate(seqlens.tolist()):  # garbage where the append goes: a skipped write cannot pass
        kc[i, n:n + sq], vc[i, n:n + sq] = kc[b, :sq], vc[b, :sq]
    out = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                     causal=causal)
    assert out.dtype == dtype and out.shape == (b, sq, hq, 128)
    assert torch.equal(kc[b].view(torch.uint8), spare)
    for i, n in enumerate(seqlens.tolist()):
        assert torch.equal(kc[i, n:n + sq].view(torch.uint8), k8_all[i, n:n + sq].view(torch.uint8))
        assert torch.equal(vc[i, n:n + sq].view(torch.uint8), v8_all[i, n:n + sq].view(torch.uint8))
    lens = [n + sq for n in seqlens.tolist()]
    # the rows below each sequence's cache_seqlens are the setup's quantized k/v: the cache now holds k8/v8 of the
    # first n + sq positions of k/v, whose unquantized values are the reference's
    _check(out, q, k, v, kc, vc, kd, vd, lens, causal=causal)


@pytest.mark.parametrize("causal, window", [(True, (255, None)), (False, (64, 16)), (True, (0, None))])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("sq", [1, 9])
def test_window_and_sink(causal, window, with_sink, sq):
    b, cap, hq, hkv = 2, 900, 16, 4
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, sq, seed=7 + sq)
    sink = torch.linspace(-2, 3, hq, device="cuda") if with_sink else None
    seqlens = torch.tensor([333, cap], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd, causal=causal,
                                     window_size=window, learnable_sink=sink)
    _check(out, q, k, v, kc, vc, kd, vd, seqlens.tolist(), causal=causal, window=window, sink=sink)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (4, 4)])
@pytest.mark.parametrize("sq", [1, 9])
@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(255, None))])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_softcap_bf16_query_over_the_e4m3_cache(dtype, hq, hkv, sq, mask, with_sink, num_splits):
    """Softcap through flash_attn_with_kvcache with a bf16/fp16 q (quantized per row in the kernel), packed GQA
    by default, split 3 ways and automatic (0, which may split or not), with appends: the bars of ``_check`` against the capped
    fp32 reference of the unquantized inputs (q times 3, so cap 5 bends scores of a few units)."""
    b, cap, softcap = 2, 900, 5.0
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, sq, seed=11 + sq + hq, dtype=dtype)
    q = 3 * q
    sink = torch.linspace(-2, 3, hq, device="cuda") if with_sink else None
    seqlens = torch.tensor([333, cap - sq], dtype=torch.int32, device="cuda")
    k_new = torch.stack([k[i, n:n + sq] for i, n in enumerate(seqlens.tolist())])
    v_new = torch.stack([v[i, n:n + sq] for i, n in enumerate(seqlens.tolist())])
    out = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                     learnable_sink=sink, softcap=softcap, num_splits=num_splits, **mask)
    _check(out, q, k, v, kc, vc, kd, vd, [n + sq for n in seqlens.tolist()], causal=mask["causal"],
           window=mask.get("window_size", (None, None)), sink=sink, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1), (4, 4)])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_kernels_query_quantization_split_and_zero_rows(dtype, hq, hkv, sq, num_splits):
    """A bf16/fp16 query quantized per (row, head) in the kernel, split off and on, with a row of zeros (batch 0,
    its last query row, head 1): every key scores 0 there, so LSE = log(keys) and O = the mean of V."""
    b, cap = 2, 700
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, sq, seed=3 + hq + sq, dtype=dtype)
    q[0, sq - 1, 1] = 0
    seqlens = torch.tensor([cap, 211], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                         causal=True, num_splits=num_splits, return_softmax_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out, q, k, v, kc, vc, kd, vd, seqlens.tolist(), causal=True)
    g = 1 // (hq // hkv)
    mean_v = (vc[0, :cap, g].float() * vd[0, g]).mean(0)  # the last query row sees every key (causal, aligned)
    torch.testing.assert_close(out[0, sq - 1, 1].float(), mean_v, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(lse[0, 1, sq - 1].item(), math.log(cap), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="q_descale given with"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, q_descale=kd)


def test_nan_in_the_query_stays_in_its_row():
    q, k, v, kc, vc, kd, vd = _setup(2, 300, 8, 2, 1, seed=4)
    q[1, 0, 5, 3] = float("nan")  # batch 1, query head 5: its own scale, its own row
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=300, k_descale=kd, v_descale=vd)
    assert torch.isnan(out[1, :, 5]).all()
    nan = torch.isnan(out)
    nan[1, :, 5] = False
    assert not nan.any()


def test_decode_step_under_cuda_graph_replay():
    b, cap, hq, hkv = 2, 1024, 32, 8
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, 1, seed=5)
    static_q, static_k, static_v = q.clone(), k[:, :1].clone(), v[:, :1].clone()
    seqlens = torch.tensor([100, 600], dtype=torch.int32, device="cuda")

    def step(kcache, vcache):
        return fa.flash_attn_with_kvcache(static_q, kcache, vcache, static_k, static_v, cache_seqlens=seqlens,
                                          k_descale=kd, v_descale=vd)

    step(kc.clone(), vc.clone())  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(kc, vc)
    # a new step: new query and keys, positions moved on
    static_q.copy_(torch.flip(q, dims=(0,)))
    static_k.copy_(k[:, 700:701])
    static_v.copy_(v[:, 700:701])
    seqlens.copy_(torch.tensor([101, 601]))
    kc_eager, vc_eager = kc.clone(), vc.clone()
    expect = kc[:b, 700].clone()  # k[:, 700] quantized with kd: the setup stored it there
    graph.replay()
    eager = step(kc_eager, vc_eager)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert torch.equal(kc.view(torch.uint8), kc_eager.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_eager.view(torch.uint8))
    assert torch.equal(kc[0, 101].view(torch.uint8), expect[0].view(torch.uint8))  # the replay's append
    assert torch.equal(kc[1, 601].view(torch.uint8), expect[1].view(torch.uint8))


def _kernel_names(fn):
    """Names of the CUDA kernels one call of ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "emcpy" not in e.name and "emset" not in e.name]


@pytest.mark.parametrize("paged", [False, True])
def test_a_decode_step_launches_only_attention_kernels(paged):
    """After the first call, a decode step over the e4m3 cache launches the FP8 kernel (and the split combine)
    and nothing else: its offsets, lengths and unit descales are kept per device and stream (fp8_rows), where
    each call made them with six small torch kernels before.  Another stream gets its own, and the results agree."""
    b, cap, hq, hkv = 8, 4096, 32, 8
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, 1, seed=6)
    kc, vc = kc[:b], vc[:b]
    kw = dict(k_descale=kd, v_descale=None)
    if paged:
        table = torch.randperm(b * cap // 16, device="cuda").view(b, cap // 16).to(torch.int32)
        def pool(c):  # key j of sequence i: row j % 16 of page table[i, j // 16]
            p = torch.empty(b * cap // 16, 16, hkv, c.shape[-1], dtype=torch.uint8, device="cuda")
            p[table.flatten().long()] = c.view(torch.uint8).reshape(b * cap // 16, 16, hkv, c.shape[-1])
            return p.view(E4)

        kc, vc = pool(kc), pool(vc)
        kw["page_table"] = table

    def call():
        return fa.flash_attn_with_kvcache(q, kc, vc, **kw)

    first = call()
    names = _kernel_names(call)
    assert names and all("Fp8" in n or "ombine" in n for n in names), names
    assert sum("Fp8" in n for n in names) == 1, names
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = call()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(other, first, rtol=0, atol=0)
    ref = fa.flash_attn_with_kvcache(q, kc, vc, k_descale=kd, v_descale=torch.ones_like(vd),
                                     **({"page_table": kw["page_table"]} if paged else {}))
    torch.testing.assert_close(first, ref, rtol=0, atol=0)  # a left-out descale is 1.0


def test_constants_asked_for_under_capture_are_not_kept():
    from flash_attn_4_sm120 import fp8_rows

    b, cap, hq, hkv = 3, 512, 8, 2
    q, k, v, kc, vc, kd, vd = _setup(b, cap, hq, hkv, 1, seed=7)
    seqlens = torch.tensor([512, 17, 300], dtype=torch.int32, device="cuda")

    def step():
        return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)

    eager = step()
    torch.cuda.synchronize()
    before = dict(fp8_rows._CONST)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert fp8_rows._CONST == before  # the capture stream's tensors live in the graph's pool: none kept
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_packed_bf16_query_over_e4m3_rows(causal):
    lens_q, lens_k = [1, 300, 0, 57], [640, 300, 10, 1200]
    b, hq, hkv = 4, 16, 4
    q, k, v = fa3_outlier_inputs(b, max(lens_q), max(lens_k), hq, hkv, 128, seed=21, device="cuda",
                                 dtype=torch.bfloat16)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    pack = lambda x, lens: torch.cat([x[i, :n] for i, n in enumerate(lens)])  # noqa: E731
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    qp = pack(q, lens_q)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), k_descale=kd, v_descale=vd,
                causal=causal)
    out, _ = fa.flash_attn_varlen_func(qp, pack(k8, lens_k), pack(v8, lens_k), **args)  # quantized in the kernel
    assert out.dtype == torch.bfloat16 and out.shape == qp.shape
    # another out_dtype: the host's per-(sequence, KV head) quantization, bitwise the e4m3 path on it
    out16, _ = fa.flash_attn_varlen_func(qp, pack(k8, lens_k), pack(v8, lens_k), out_dtype=torch.float16, **args)
    q8, qd = quantize_query_packed(qp, hkv, cu_q)
    out8, _ = fa.flash_attn_varlen_func(q8, pack(k8, lens_k), pack(v8, lens_k), q_descale=qd,
                                        out_dtype=torch.float16, **args)
    torch.testing.assert_close(out16, out8, rtol=0, atol=0)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        rows = out[int(cu_q[i]):int(cu_q[i]) + lq][None]
        _check(rows, q[i:i + 1, :lq], k[i:i + 1, :lk], v[i:i + 1, :lk], k8[i:i + 1, :lk], v8[i:i + 1, :lk],
               kd[i:i + 1], vd[i:i + 1], [lk], causal=causal)
