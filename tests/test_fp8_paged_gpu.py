"""A paged FP8 (e4m3) KV cache on a GPU (flash_attn_with_kvcache with page_table; kernels/fwd_fp8.py's paged form).

The paged kernel is the contiguous kernel with other addresses: same tiles, same split ranges, same math.  So every
test here compares a paged call with the same call over the same bytes laid out contiguously and asks for BITWISE
equality (out and lse); the contiguous path's accuracy against the fp32 reference is tests/test_fp8_kvcache_gpu.py's.
Page sizes 1 (every row its own page), 16 (a 64-key tile spans four pages), 64 (one page per tile) and 256 (four
tiles per page); GQA 1/4/8; Sq 1 (the key-split decode tile) and 5; split off and on; bf16 and fp16 queries (quantized
per (row, head) in the kernel) with a row of zeros; softcap; appends crossing pages; a
lying page table and lying cache_seqlens (clamped: must not fault; run this file under compute-sanitizer too);
pools that are views of a fused cache; CUDA-graph replay.
"""

import math

import pytest
import torch

from flash_attn_4_sm120.fp8_quant import quantize_qkv
from tests.fp8_emulation import fa3_outlier_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")

E4 = torch.float8_e4m3fn
CAP = 512  # keys per sequence: a multiple of every page size here, so both layouts have the same capacity


def _setup(b, hq, hkv, sq, d=128, seed=0, dtype=torch.bfloat16):
    """q (B, Sq, Hq, D) in ``dtype``; the e4m3 contiguous cache (B, CAP, Hkv, D) with (B, Hkv) descales, and the
    bf16 k/v it came from (for appends)."""
    q, k, v = fa3_outlier_inputs(b, sq, CAP, hq, hkv, d, seed=seed, device="cuda", dtype=dtype)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    return q, k, v, k8.contiguous(), v8.contiguous(), kd, vd


def _scatter(cache, page_size, seed=0, spare=5, fused=False):
    """The contiguous cache's rows in a pool of shuffled pages: (pool (P, page_size, Hkv, D), table (B, CAP /
    page_size) int32); sequence b's key j is row j % page_size of page table[b, j // page_size].  Spare pages hold
    NaN bytes (never read).  ``fused``: the pool is one half of a (P, page_size, 2, Hkv, D) tensor."""
    b, cap, hkv, d = cache.shape
    width = cap // page_size
    pages = b * width + spare
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).to(cache.device)
    table = perm[: b * width].view(b, width).to(torch.int32)
    shape = (pages, page_size, 2, hkv, d) if fused else (pages, page_size, hkv, d)
    store = torch.full(shape, 0x7F, dtype=torch.uint8, device=cache.device)  # 0x7F: e4m3 NaN
    pool = store[:, :, 0] if fused else store
    src = cache.view(torch.uint8).view(b, width, page_size, hkv, d)
    pool[table.long()] = src
    return pool.view(E4), table


def _paged_and_contiguous(q, kc, vc, page_size, fused=False, seed=0, **kw):
    kp, table = _scatter(kc, page_size, seed=seed, fused=fused)
    vp, table_v = _scatter(vc, page_size, seed=seed, fused=fused)
    assert torch.equal(table, table_v)
    out_c, lse_c = fa.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    out_p, lse_p = fa.flash_attn_with_kvcache(q, kp, vp, page_table=table, return_softmax_lse=True, **kw)
    return (out_p, lse_p), (out_c, lse_c), (kp, vp, table)


def _same(a, b):
    assert not torch.isnan(a[0]).any()
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (16, 4), (32, 4)])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_is_bitwise_the_contiguous_cache(page_size, hq, hkv, sq, num_splits):
    b = 3
    q, _, _, kc, vc, kd, vd = _setup(b, hq, hkv, sq, seed=page_size + hq)
    seqlens = torch.tensor([1, 300, CAP], dtype=torch.int32, device="cuda")
    paged, contiguous, _ = _paged_and_contiguous(q, kc, vc, page_size, cache_seqlens=seqlens, k_descale=kd,
                                                 v_descale=vd, causal=True, num_splits=num_splits)
    _same(paged, contiguous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, E4])
@pytest.mark.parametrize("page_size", [16, 64])
def test_window_sink_query_dtypes_and_fused_pools(dtype, page_size):
    b, hq, hkv, sq = 2, 16, 4, 3
    q, _, _, kc, vc, kd, vd = _setup(b, hq, hkv, sq, d=64, seed=3, dtype=torch.bfloat16 if dtype == E4 else dtype)
    kw = dict(cache_seqlens=torch.tensor([200, 77], dtype=torch.int32, device="cuda"), k_descale=kd,
              v_descale=vd, causal=True, window_size=(40, 0),
              learnable_sink=torch.randn(hq, device="cuda"))
    if dtype == E4:
        q, kw["q_descale"] = q.to(E4), torch.full((b, hkv), 1.0, device="cuda")
    for fused in (False, True):
        paged, contiguous, _ = _paged_and_contiguous(q, kc, vc, page_size, fused=fused, **kw)
        _same(paged, contiguous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (32, 4)])
@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_softcap_paged_is_bitwise_the_contiguous_cache(dtype, page_size, hq, hkv, sq, num_splits):
    """Softcap with a window and a sink over pages: the contiguous call's bits (its accuracy against the capped
    reference: tests/test_fp8_kvcache_gpu.py), and a result the cap changed."""
    b = 2
    q, _, _, kc, vc, kd, vd = _setup(b, hq, hkv, sq, seed=page_size + hq + sq)
    q = 3 * q  # scores of a few units: cap 5 bends them
    kw = dict(cache_seqlens=torch.tensor([300, CAP], dtype=torch.int32, device="cuda"), k_descale=kd,
              v_descale=vd, causal=True, window_size=(200, 0), learnable_sink=torch.linspace(-2, 2, hq, device="cuda"),
              num_splits=num_splits)
    if dtype == E4:
        q, kw["q_descale"] = q.to(E4), torch.full((b, hkv), 1.0, device="cuda")
    paged, contiguous, (kp, vp, table) = _paged_and_contiguous(q, kc, vc, page_size, softcap=5.0, **kw)
    _same(paged, contiguous)
    plain = fa.flash_attn_with_kvcache(q, kp, vp, page_table=table, **kw)
    assert (plain.float() - paged[0].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_kernels_query_quantization_on_pages(dtype, hq, hkv, sq, num_splits):
    """A bf16/fp16 query quantized per (row, head) in the kernel (Fp8FwdConfig.q_dtype) over pages, with a row of
    zeros: bitwise the contiguous call, and the zero row scores every key 0 (LSE = log(keys))."""
    b = 2
    q, _, _, kc, vc, kd, vd = _setup(b, hq, hkv, sq, seed=11 + hq + sq, dtype=dtype)
    q[1, sq - 1, hq - 1] = 0
    seqlens = torch.tensor([CAP, 130], dtype=torch.int32, device="cuda")
    paged, contiguous, _ = _paged_and_contiguous(q, kc, vc, 16, cache_seqlens=seqlens, k_descale=kd, v_descale=vd,
                                                 causal=True, num_splits=num_splits)
    _same(paged, contiguous)
    assert paged[0].dtype == dtype
    torch.testing.assert_close(paged[1][1, hq - 1, sq - 1].item(), math.log(130), rtol=0, atol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("new_dtype", [torch.bfloat16, E4])
def test_appends_into_pages_then_attend(page_size, new_dtype):
    b, hq, hkv, sq = 2, 32, 8, 4
    q, k, v, kc, vc, kd, vd = _setup(b, hq, hkv, sq, seed=11)
    seqlens = torch.tensor([14, 250], dtype=torch.int32, device="cuda")  # 14 + 4 crosses a 16-row page
    kp, table = _scatter(kc, page_size, seed=2)
    vp, _ = _scatter(vc, page_size, seed=2)
    k_new, v_new = k[:, 300:300 + sq], v[:, 300:300 + sq]
    if new_dtype == E4:
        k_new, v_new = kc[:, 300:300 + sq].clone(), vc[:, 300:300 + sq].clone()
    kw = dict(cache_seqlens=seqlens, k_descale=kd, v_descale=vd, causal=True, return_softmax_lse=True)
    paged = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, page_table=table, **kw)
    contiguous = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, **kw)
    _same(paged, contiguous)
    # the pools hold the contiguous cache's bytes (appended rows included) through the table; spare pages untouched
    rows = table.long()[:, :, None] * page_size + torch.arange(page_size, device="cuda")
    for pool, cache in ((kp, kc), (vp, vc)):
        flat = pool.view(torch.uint8).flatten(0, 1)
        assert torch.equal(flat[rows.flatten(1)], cache.view(torch.uint8))
        spare = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
        spare[rows.flatten()] = False
        assert (flat[spare] == 0x7F).all()


def test_a_lying_table_and_lengths_do_not_fault():
    """Entries past the pool and negative ones read the last / first page; cache_seqlens past the table's capacity
    or negative read capacity / no keys: bitwise the call with those values clamped (compute-sanitizer: clean)."""
    b, hq, hkv = 3, 32, 8
    q, _, _, kc, vc, kd, vd = _setup(b, hq, hkv, 1, seed=17)
    kp, table = _scatter(kc, 16, seed=4, spare=0)
    vp, _ = _scatter(vc, 16, seed=4, spare=0)
    pages = kp.shape[0]
    lying = table.clone()
    lying[0, 3], lying[1, 0], lying[2, 31] = 2 ** 31 - 1, -5, pages
    fixed = lying.clamp(0, pages - 1)
    seq_lie = torch.tensor([2 ** 30, -40, 300], dtype=torch.int32, device="cuda")
    seq_fix = torch.tensor([CAP, 0, 300], dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        kw = dict(k_descale=kd, v_descale=vd, return_softmax_lse=True, num_splits=splits)
        got = fa.flash_attn_with_kvcache(q, kp, vp, page_table=lying, cache_seqlens=seq_lie, **kw)
        want = fa.flash_attn_with_kvcache(q, kp, vp, page_table=fixed, cache_seqlens=seq_fix, **kw)
        torch.cuda.synchronize()
        torch.testing.assert_close(got[0][[0, 2]], want[0][[0, 2]], rtol=0, atol=0)
        assert (got[0][1] == 0).all() and torch.isneginf(got[1][1]).all()  # no keys: O = 0, LSE = -inf


def test_decode_step_under_cuda_graph_replay():
    b, hq, hkv, page_size = 4, 32, 8, 16
    q, k, v, kc, vc, kd, vd = _setup(b, hq, hkv, 1, seed=23)
    kp, table = _scatter(kc, page_size, seed=6)
    vp, _ = _scatter(vc, page_size, seed=6)
    static_q, static_k, static_v = q.clone(), k[:, :1].clone(), v[:, :1].clone()
    static_table = table.clone()
    seqlens = torch.tensor([15, 100, 300, 16], dtype=torch.int32, device="cuda")

    def step(kpool, vpool):
        return fa.flash_attn_with_kvcache(static_q, kpool, vpool, static_k, static_v, cache_seqlens=seqlens,
                                          page_table=static_table, k_descale=kd, v_descale=vd)

    step(kp.clone(), vp.clone())  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(kp, vp)
    static_q.copy_(torch.flip(q, dims=(0,)))
    static_k.copy_(k[:, 400:401])
    static_v.copy_(v[:, 400:401])
    seqlens.copy_(torch.tensor([16, 101, 301, 17]))
    static_table.copy_(torch.flip(table, dims=(0,)))  # the table may change between replays too
    kp_eager, vp_eager = kp.clone(), vp.clone()
    graph.replay()
    eager = step(kp_eager, vp_eager)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert torch.equal(kp.view(torch.uint8), kp_eager.view(torch.uint8))
    assert torch.equal(vp.view(torch.uint8), vp_eager.view(torch.uint8))
