"""Paged K/V on a GPU, against the fp32 reference (tests/reference.py); flash_attn_with_kvcache: test_kvcache_gpu.py.

Bar (as test_fwd_gpu): max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol, LSE within 1e-3.
Every pool is filled with NaN first and only the rows of valid positions are written, so a read of an unused page,
of a row of a last page past seqused_k, or of a padding entry (-1) of the page table shows up as NaN.
"""

import math

import pytest
import torch

from reference import attention_ref
from test_fwd_gpu import _compare

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


class Paged:
    """Dense per-sequence K/V (B, Lmax, Hkv, D) and the same keys scattered over a NaN-filled page pool through
    a random page permutation; page-table padding is -1 (as transformers pads)."""

    def __init__(self, lens, page_size, hkv, d, dv, dtype=torch.bfloat16, seed=0, fused=None, extra_pages=3,
                 extra_cols=1):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.lens = list(lens)
        self.page_size = ps = page_size
        batch, lmax = len(lens), max(max(lens), 1)
        self.k = _rand(batch, lmax, hkv, d, dtype=dtype, gen=g)
        self.v = _rand(batch, lmax, hkv, dv, dtype=dtype, gen=g)
        pages_per = [-(-n // ps) for n in lens]
        max_pages = max(pages_per + [1]) + extra_cols
        num_pages = sum(pages_per) + extra_pages
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        table = torch.full((batch, max_pages), -1, dtype=torch.int32)
        i = 0
        for b, n in enumerate(pages_per):
            for c in range(n):
                table[b, c] = perm[i]
                i += 1
        self.table = table.cuda()
        if fused == "2nb":  # vLLM's flash-attn layout (2, num_blocks, block_size, Hkv, D), unbound
            self.cache = torch.full((2, num_pages, ps, hkv, d), float("nan"), dtype=dtype, device="cuda")
            self.kp, self.vp = self.cache[0], self.cache[1]
        elif fused == "nb2":  # (num_blocks, 2, block_size, Hkv, D): k/v page stride is twice a page
            self.cache = torch.full((num_pages, 2, ps, hkv, d), float("nan"), dtype=dtype, device="cuda")
            self.kp, self.vp = self.cache[:, 0], self.cache[:, 1]
        else:
            self.kp = torch.full((num_pages, ps, hkv, d), float("nan"), dtype=dtype, device="cuda")
            self.vp = torch.full((num_pages, ps, hkv, dv), float("nan"), dtype=dtype, device="cuda")
        bi = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)], dtype=torch.long, device="cuda")
        pos = torch.tensor([p for n in lens for p in range(n)], dtype=torch.long, device="cuda")
        if bi.numel():
            pages = self.table.long()[bi, pos // ps]
            self.kp[pages, pos % ps] = self.k[bi, pos]
            self.vp[pages, pos % ps] = self.v[bi, pos]
        self.seqused = torch.tensor(lens, dtype=torch.int32, device="cuda")
        assert torch.isnan(self.kp).any() or sum(lens) == num_pages * ps


def _ref_rows(q_rows, k, v, kw):
    """fp32 reference, same-dtype reference for one sequence; q_rows (1, Sq, Hq, D), k/v (1, Sk, ...)."""
    hq, sq = q_rows.shape[2], q_rows.shape[1]
    if k.shape[1] == 0:
        out = torch.zeros(1, sq, hq, v.shape[-1], dtype=q_rows.dtype, device="cuda")
        sink = kw.get("sink")
        lse = (sink.float().view(1, hq, 1).expand(1, hq, sq).clone() if sink is not None
               else torch.full((1, hq, sq), -math.inf, device="cuda"))
        return out, lse, out
    ref, lse = attention_ref(q_rows, k, v, upcast=True, **kw)
    pt, _ = attention_ref(q_rows, k, v, upcast=False, **kw)
    return ref, lse, pt


def check_dense_q(out, lse, q, pg: Paged, **kw):
    """q (B, Sq, Hq, D) over the paged keys of each sequence."""
    refs, lses, pts = [], [], []
    for b, n in enumerate(pg.lens):
        r, l_, p = _ref_rows(q[b:b + 1], pg.k[b:b + 1, :n], pg.v[b:b + 1, :n], kw)
        refs.append(r), lses.append(l_), pts.append(p)
    _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))


def check_varlen_q(out, lse, q, cu_q, pg: Paged, **kw):
    """q (total_q, Hq, D) with cu_seqlens_q over the paged keys; lse (Hq, total_q)."""
    cu = cu_q.tolist()
    refs, lses, pts = [], [], []
    for b, n in enumerate(pg.lens):
        qb = q[cu[b]:cu[b + 1]][None]
        r, l_, p = _ref_rows(qb, pg.k[b:b + 1, :n], pg.v[b:b + 1, :n], kw)
        refs.append(r[0]), lses.append(l_[0]), pts.append(p[0])
    _compare(out, lse, torch.cat(refs), torch.cat(lses, dim=1), torch.cat(pts))


def _window_kw(causal, window):
    left, right = window
    return dict(causal=causal, window=(left, right))


# ---- paged K/V through flash_attn_varlen_func ------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("sq", [1, 5, 16, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_page_sizes(page_size, sq, causal):
    # zero length, exactly full pages, a partial last page, one long sequence
    lens = [0, 2 * page_size, 3 * page_size + 1, 700]
    pg = Paged(lens, page_size, 2, 128, 128, seed=page_size + sq)
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = _rand(len(lens), sq, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                         return_lse=True)
    check_dense_q(out, lse, q, pg, causal=causal)


@pytest.mark.parametrize("mask", ["none", "causal", "win_64_0", "win_32_16", "win_none_48", "win_100_none",
                                  "causal_left_77"])
@pytest.mark.parametrize("softcap,sink", [(0.0, False), (30.0, True)])
@pytest.mark.parametrize("page_size", [16, 3])
def test_paged_masks(mask, softcap, sink, page_size):
    causal = mask.startswith("causal")
    window = {"none": (None, None), "causal": (None, None), "win_64_0": (64, 0), "win_32_16": (32, 16),
              "win_none_48": (None, 48), "win_100_none": (100, None), "causal_left_77": (77, None)}[mask]
    lens = [333, 17, 129]
    pg = Paged(lens, page_size, 2, 64, 64, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    q = _rand(3, 113, 8, 64, dtype=torch.bfloat16, gen=g) * (3 if softcap else 1)
    s = torch.randn(8, device="cuda", generator=g) * 2 if sink else None
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                         window_size=window, softcap=softcap, learnable_sink=s, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=causal, window=window, softcap=softcap, sink=s)


@pytest.mark.parametrize("d,dv", [(32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128),
                                  (256, 128), (128, 64)])
@pytest.mark.parametrize("page_size", [3, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_head_dims(d, dv, page_size, dtype):
    if dtype == torch.float16 and (d, dv) not in [(128, 128), (256, 256)]:
        pytest.skip("fp16 on a subset (the kernels share everything but the mma type)")
    lens = [257, 64, 1]
    pg = Paged(lens, page_size, 2, d, dv, dtype=dtype, seed=d + dv)
    g = torch.Generator(device="cuda").manual_seed(d)
    q = _rand(3, 37, 4, d, dtype=dtype, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1), (8, 1), (32, 4)])
@pytest.mark.parametrize("pack_gqa", [None, False, True])
@pytest.mark.parametrize("sq", [1, 16, 300])
def test_paged_gqa(hq, hkv, pack_gqa, sq):
    lens = [1000, 5, 64]
    pg = Paged(lens, 16, hkv, 128, 128, seed=hq * hkv)
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = _rand(3, sq, hq, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         pack_gqa=pack_gqa, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("window", [(None, None), (128, None)])
def test_paged_chunked_prefill(page_size, window):
    """varlen q (cu_seqlens_q) over a paged cache: each sequence's new chunk attends to its whole context."""
    lens = [600, 0, 77, 300]
    qlens = [512, 0, 1, 300]
    pg = Paged(lens, page_size, 2, 128, 128, seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    q = _rand(sum(qlens), 8, 128, dtype=torch.bfloat16, gen=g)
    cu_q = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, cu_seqlens_q=cu_q, max_seqlen_q=max(qlens),
                                         seqused_k=pg.seqused, page_table=pg.table, causal=True, window_size=window,
                                         return_lse=True)
    check_varlen_q(out, lse, q, cu_q, pg, causal=True, window=window)


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("layout", ["2nb", "nb2"])
def test_paged_fused_cache_views(page_size, layout):
    """k and v as two views of one fused cache tensor; with (num_blocks, 2, ...) the page stride is 2 pages."""
    lens = [100, 33]
    pg = Paged(lens, page_size, 2, 128, 128, seed=31, fused=layout)
    assert pg.kp.untyped_storage().data_ptr() == pg.vp.untyped_storage().data_ptr()
    if layout == "nb2":
        assert pg.kp.stride(0) == 2 * page_size * 2 * 128 and not pg.kp.is_contiguous()
    g = torch.Generator(device="cuda").manual_seed(32)
    q = _rand(2, 1, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


def test_paged_nan_in_unused_rows_of_the_last_page():
    pg = Paged([17, 31], 16, 2, 64, 64, seed=41)
    last = int(pg.table[0, 1])
    assert torch.isnan(pg.kp[last, 1:]).all() and torch.isnan(pg.vp[last, 1:]).all()  # rows 17..31 of seq 0
    g = torch.Generator(device="cuda").manual_seed(42)
    q = _rand(2, 3, 4, 64, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table,
                                         return_lse=True)
    assert torch.isfinite(out).all()
    check_dense_q(out, lse, q, pg)


def test_paged_flash_attn_func_full_pages():
    """flash_attn_func with a page table: every sequence is max_pages * page_size keys long."""
    pg = Paged([48, 48], 16, 2, 64, 64, seed=51, extra_cols=0)
    g = torch.Generator(device="cuda").manual_seed(52)
    q = _rand(2, 7, 4, 64, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, pg.kp, pg.vp, page_table=pg.table, causal=True, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


def test_paged_max_seqlen_k_default_and_given():
    pg = Paged([40, 10], 8, 1, 64, 64, seed=61)
    g = torch.Generator(device="cuda").manual_seed(62)
    q = _rand(2, 1, 2, 64, dtype=torch.bfloat16, gen=g)
    a = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table)[0]
    b = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, max_seqlen_k=40)[0]
    assert torch.equal(a, b)
    check_dense_q(a, None, q, pg)


def test_paged_out_of_range_pages_are_clamped_and_found_by_debug_checks():
    pg = Paged([40, 10], 8, 1, 64, 64, seed=71)
    bad = pg.table.clone()
    bad[0, 1] = 10_000  # used by sequence 0
    bad[1, 3] = -5  # past sequence 1's pages: padding, never read, not an error
    g = torch.Generator(device="cuda").manual_seed(72)
    q = _rand(2, 1, 2, 64, dtype=torch.bfloat16, gen=g)
    out, _ = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=bad)
    torch.cuda.synchronize()  # no fault: the index was clamped to the pool
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=r"page_table\[0, 1\]=10000"):
        fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=bad, debug_checks=True)
    fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, debug_checks=True)


@pytest.mark.parametrize("name", ["int64 table", "1-D table", "cu_seqlens_k", "page shapes", "page size 0",
                                  "requires grad", "num_splits float"])
def test_paged_bad_inputs_raise_before_launch(name):
    pg = Paged([20, 5], 8, 2, 64, 64, seed=81)
    q = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16, device="cuda")
    kw = dict(seqused_k=pg.seqused, page_table=pg.table)
    k, v = pg.kp, pg.vp
    if name == "int64 table":
        kw["page_table"] = pg.table.long()
    elif name == "1-D table":
        kw["page_table"] = pg.table[0]
    elif name == "cu_seqlens_k":
        kw["cu_seqlens_k"] = torch.tensor([0, 20, 25], dtype=torch.int32, device="cuda")
    elif name == "page shapes":
        v = pg.vp[:, :4]
    elif name == "page size 0":
        k, v = pg.kp[:, :0], pg.vp[:, :0]
    elif name == "requires grad":
        q = q.requires_grad_()
    elif name == "num_splits float":
        kw["num_splits"] = 1.0
    with pytest.raises(ValueError):
        fa.flash_attn_varlen_func(q, k, v, **kw)


# ---- paged K/V on the TMA kernel (page_size % tile_n == 0) ----------------------------------------------------
def _expect_tma(pg: Paged, d, dv, windowed, expected=None):
    """The call below runs the TMA kernel exactly when the prefill tile's tile_n divides the page size."""
    from flash_attn_4_sm120 import config, plan as P

    if expected is None:
        expected = pg.page_size % config.select_fwd_tile(d, dv, windowed).tile_n == 0
    assert P.paged_eligible_for_tma(pg.kp, pg.vp, d, dv, windowed) == expected


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_paged_tma_prefill(d, page_size, causal, varlen_q, hq, hkv):
    """Random page permutation, NaN in the unused tail of each last page and in the spare pages, a zero-length
    sequence, full pages, short and long sequences; dense or varlen q; GQA or not."""
    lens = [3 * page_size + 17, 0, 2 * page_size, 700, 5]
    pg = Paged(lens, page_size, hkv, d, d, seed=d + page_size + 7 * causal + 3 * varlen_q + hkv)
    last = int(pg.table[0, 3])
    assert torch.isnan(pg.kp[last, 17:]).all() and torch.isnan(pg.vp[last, 17:]).all()
    _expect_tma(pg, d, d, causal)
    g = torch.Generator(device="cuda").manual_seed(d + page_size)
    if varlen_q:
        qlens = [300, 0, 128, 512, 1]
        q = _rand(sum(qlens), hq, d, dtype=torch.bfloat16, gen=g)
        cu_q = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, cu_seqlens_q=cu_q, max_seqlen_q=max(qlens),
                                             seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                             return_lse=True)
        check_varlen_q(out, lse, q, cu_q, pg, causal=causal)
    else:
        q = _rand(len(lens), 200, hq, d, dtype=torch.bfloat16, gen=g)
        out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table,
                                             causal=causal, return_lse=True)
        check_dense_q(out, lse, q, pg, causal=causal)


@pytest.mark.parametrize("mask", ["causal", "win_64_0", "win_100_none", "win_none_48"])
@pytest.mark.parametrize("softcap,sink", [(0.0, False), (30.0, True)])
@pytest.mark.parametrize("pack_gqa", [None, False, True])
def test_paged_tma_masks_softcap_sink(mask, softcap, sink, pack_gqa):
    """The chunked-prefill shape of the benchmark, smaller: Hq 32 / Hkv 8, d128, page 64, q chunks over a longer
    paged context (bottom-right causal), with windows, softcap and a sink."""
    causal = mask == "causal"
    window = {"causal": (None, None), "win_64_0": (64, 0), "win_100_none": (100, None),
              "win_none_48": (None, 48)}[mask]
    lens = [1000, 333, 64]
    qlens = [256, 100, 64]
    pg = Paged(lens, 64, 8, 128, 128, seed=201)
    _expect_tma(pg, 128, 128, True, expected=True)
    g = torch.Generator(device="cuda").manual_seed(202)
    q = _rand(sum(qlens), 32, 128, dtype=torch.bfloat16, gen=g) * (3 if softcap else 1)
    cu_q = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    s = torch.randn(32, device="cuda", generator=g) * 2 if sink else None
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, cu_seqlens_q=cu_q, max_seqlen_q=max(qlens),
                                         seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                         window_size=window, softcap=softcap, learnable_sink=s, pack_gqa=pack_gqa,
                                         return_lse=True)
    check_varlen_q(out, lse, q, cu_q, pg, causal=causal, window=window, softcap=softcap, sink=s)


@pytest.mark.parametrize("layout", ["2nb", "nb2"])
@pytest.mark.parametrize("page_size", [64, 128])
def test_paged_tma_fused_cache_views(layout, page_size):
    """k and v as two views of one fused cache: both qualify for TMA (16-byte aligned bases and strides)."""
    lens = [400, 129]
    pg = Paged(lens, page_size, 2, 128, 128, seed=211, fused=layout)
    _expect_tma(pg, 128, 128, True, expected=True)
    g = torch.Generator(device="cuda").manual_seed(212)
    q = _rand(2, 150, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


def test_paged_tma_matches_cpasync_and_contiguous():
    """The same keys through the TMA kernel (page 64), the cp.async kernel (page 16) and contiguous K/V."""
    lens = [777, 64, 1]
    g = torch.Generator(device="cuda").manual_seed(221)
    q = _rand(3, 256, 8, 128, dtype=torch.bfloat16, gen=g)
    outs = []
    for ps in (64, 16):
        pg = Paged(lens, ps, 2, 128, 128, seed=222)
        _expect_tma(pg, 128, 128, True, expected=ps == 64)
        outs.append(fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table,
                                              causal=True, return_lse=True))
    dense = fa.flash_attn_varlen_func(q, pg.k, pg.v, seqused_k=pg.seqused, causal=True, return_lse=True)
    for o, l_ in outs:
        torch.testing.assert_close(o, dense[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(l_, dense[1], atol=1e-3, rtol=0)
    check_dense_q(outs[0][0], outs[0][1], q, pg, causal=True)


def test_paged_tma_out_of_range_pages_are_clamped():
    pg = Paged([300, 100], 64, 2, 128, 128, seed=231)
    _expect_tma(pg, 128, 128, False, expected=True)
    bad = pg.table.clone()
    bad[0, 1] = 10_000  # used by sequence 0: clamped to the last page of the pool
    bad[1, 0] = -7  # clamped to page 0
    g = torch.Generator(device="cuda").manual_seed(232)
    q = _rand(2, 128, 8, 128, dtype=torch.bfloat16, gen=g)
    out, _ = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=bad)
    torch.cuda.synchronize()  # no fault
    assert out.shape == q.shape


def test_paged_under_torch_compile():
    """The page table goes through the torch.library op (no graph break); inference only."""
    pg = Paged([90, 7], 16, 2, 128, 128, seed=131)
    g = torch.Generator(device="cuda").manual_seed(132)
    q = _rand(2, 1, 8, 128, dtype=torch.bfloat16, gen=g)

    @torch.compile(fullgraph=True)
    def decode(q, kp, vp, used, table):
        return fa.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, causal=True,
                                         return_lse=True)

    with torch.no_grad():
        out, lse = decode(q, pg.kp, pg.vp, pg.seqused, pg.table)
    check_dense_q(out, lse, q, pg, causal=True)
