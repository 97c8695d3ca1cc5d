"""flash_attn_with_kvcache on a GPU, against the fp32 reference (tests/reference.py), with the bar of test_fwd_gpu:
max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol, LSE within 1e-3.

The append of new keys (paged across page boundaries, contiguous with cache_batch_idx, int or tensor
cache_seqlens: exactly the appended rows change), attention over the cache without an append (window, softcap,
sink), and one decode step captured in a CUDA graph and replayed with new cache contents and cache_seqlens (one
split and the automatic split). Pools are NaN-filled as in test_paged_gpu. The host side: tests/test_kvcache.py.
"""

import pytest
import torch

from test_fwd_gpu import _compare
from test_paged_gpu import Paged, _rand, _ref_rows, check_dense_q

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")

@pytest.mark.parametrize("page_size", [16, 5, 1])
@pytest.mark.parametrize("new", [1, 5])
def test_kvcache_paged_append_across_a_page_boundary(page_size, new):
    lens = [page_size - 1, 2 * page_size, 0, 37]  # the first append crosses into the next page
    hkv, d = 2, 128
    pg = Paged(lens, page_size, hkv, d, d, seed=91, extra_cols=new // page_size + 2,
               extra_pages=len(lens) * (new // page_size + 2))
    g = torch.Generator(device="cuda").manual_seed(92)
    q = _rand(4, new, 8, d, dtype=torch.bfloat16, gen=g)
    kn = _rand(4, new, hkv, d, dtype=torch.bfloat16, gen=g)
    vn = _rand(4, new, hkv, d, dtype=torch.bfloat16, gen=g)
    # the pages the appended rows land in: allocate them in the table (from the spare pages) where needed
    num_pages = pg.kp.shape[0]
    spare = [p for p in range(num_pages) if p not in set(pg.table[pg.table >= 0].tolist())]
    for b, n in enumerate(lens):
        for c in range(-(-n // page_size), -(-(n + new) // page_size)):
            if int(pg.table[b, c]) < 0:
                pg.table[b, c] = spare.pop()
    before_k, before_v = pg.kp.clone(), pg.vp.clone()
    out, lse = fa.flash_attn_with_kvcache(q, pg.kp, pg.vp, kn, vn, cache_seqlens=pg.seqused, block_table=pg.table,
                                         causal=True, return_softmax_lse=True)
    # cache contents: exactly the appended rows changed, at the right places
    exp_k, exp_v = before_k.clone(), before_v.clone()
    for b, n in enumerate(lens):
        for i in range(new):
            p = n + i
            page, row = int(pg.table[b, p // page_size]), p % page_size
            exp_k[page, row], exp_v[page, row] = kn[b, i], vn[b, i]
    assert torch.equal(torch.nan_to_num(pg.kp, 7.0), torch.nan_to_num(exp_k, 7.0))
    assert torch.equal(torch.nan_to_num(pg.vp, 7.0), torch.nan_to_num(exp_v, 7.0))
    # output: attention over old + new keys
    refs, lses, pts = [], [], []
    for b, n in enumerate(lens):
        kb = torch.cat([pg.k[b:b + 1, :n], kn[b:b + 1]], 1)
        vb = torch.cat([pg.v[b:b + 1, :n], vn[b:b + 1]], 1)
        r, l_, p = _ref_rows(q[b:b + 1], kb, vb, dict(causal=True))
        refs.append(r), lses.append(l_), pts.append(p)
    _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))


@pytest.mark.parametrize("use_idx", [False, True])
@pytest.mark.parametrize("int_seqlens", [False, True])
def test_kvcache_contiguous_append_and_cache_batch_idx(use_idx, int_seqlens):
    b, s_cache, hkv, d = 3, 256, 2, 64
    g = torch.Generator(device="cuda").manual_seed(101)
    kc = _rand(5, s_cache, hkv, d, dtype=torch.bfloat16, gen=g)
    vc = _rand(5, s_cache, hkv, d, dtype=torch.bfloat16, gen=g)
    lens = [100] * b if int_seqlens else [100, 0, 250]
    seqlens = 100 if int_seqlens else torch.tensor(lens, dtype=torch.int32, device="cuda")
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda") if use_idx else None
    rows = idx.tolist() if use_idx else list(range(b))
    kc[rows[0], 150:] = float("nan")  # past every length: must never be read
    q = _rand(b, 3, 4, d, dtype=torch.bfloat16, gen=g)
    kn = _rand(b, 3, hkv, d, dtype=torch.bfloat16, gen=g)
    vn = _rand(b, 3, hkv, d, dtype=torch.bfloat16, gen=g)
    before = kc.clone()
    out = fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    for i, (r, n) in enumerate(zip(rows, lens)):
        assert torch.equal(kc[r, n:n + 3], kn[i]) and torch.equal(vc[r, n:n + 3], vn[i])
        assert torch.equal(torch.nan_to_num(kc[r, :n], 7.0), torch.nan_to_num(before[r, :n], 7.0))
    refs, lses, pts = [], [], []
    for i, (r, n) in enumerate(zip(rows, lens)):
        ref, l_, p = _ref_rows(q[i:i + 1], kc[r:r + 1, :n + 3], vc[r:r + 1, :n + 3], dict(causal=True))
        refs.append(ref), lses.append(l_), pts.append(p)
    _compare(out, None, torch.cat(refs), torch.cat(lses), torch.cat(pts))


def test_kvcache_without_append_and_with_window_softcap_sink():
    pg = Paged([300, 1, 64], 16, 2, 128, 128, seed=111)
    g = torch.Generator(device="cuda").manual_seed(112)
    q = _rand(3, 1, 8, 128, dtype=torch.bfloat16, gen=g) * 3
    sink = torch.randn(8, device="cuda", generator=g)
    out, lse = fa.flash_attn_with_kvcache(q, pg.kp, pg.vp, cache_seqlens=pg.seqused, page_table=pg.table,
                                         causal=True, window_size=(63, 0), softcap=20.0, learnable_sink=sink,
                                         return_softmax_lse=True)
    check_dense_q(out, lse, q, pg, causal=True, window=(63, None), softcap=20.0, sink=sink)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_cuda_graph_capture_and_replay(paged):
    """Capture one decode step, then replay with new cache contents, new query/new keys and new cache_seqlens."""
    b, hkv, hq, d, ps = 4, 2, 8, 128, 16
    cap = 512
    g = torch.Generator(device="cuda").manual_seed(121)
    if paged:
        num_pages = b * cap // ps
        kc = _rand(num_pages, ps, hkv, d, dtype=torch.bfloat16, gen=g)
        vc = _rand(num_pages, ps, hkv, d, dtype=torch.bfloat16, gen=g)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(3))
        table = perm.view(b, cap // ps).to(torch.int32).cuda()
    else:
        kc = _rand(b, cap, hkv, d, dtype=torch.bfloat16, gen=g)
        vc = _rand(b, cap, hkv, d, dtype=torch.bfloat16, gen=g)
        table = None
    q = _rand(b, 1, hq, d, dtype=torch.bfloat16, gen=g)
    kn = _rand(b, 1, hkv, d, dtype=torch.bfloat16, gen=g)
    vn = _rand(b, 1, hkv, d, dtype=torch.bfloat16, gen=g)
    seqlens = torch.tensor([10, 100, 0, 300], dtype=torch.int32, device="cuda")

    def step():
        return fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, page_table=table, causal=True,
                                          return_softmax_lse=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()

    def dense_rows(cache, bi, n):
        if not paged:
            return cache[bi:bi + 1, :n]
        pos = torch.arange(n, device="cuda")
        return cache[table[bi].long()[pos // ps], pos % ps][None]

    for trial, lens in enumerate(([5, 200, 17, 480], [0, 1, 511, 64])):
        kc.copy_(_rand(*kc.shape, dtype=torch.bfloat16, gen=g))
        vc.copy_(_rand(*vc.shape, dtype=torch.bfloat16, gen=g))
        q.copy_(_rand(*q.shape, dtype=torch.bfloat16, gen=g))
        kn.copy_(_rand(*kn.shape, dtype=torch.bfloat16, gen=g))
        vn.copy_(_rand(*vn.shape, dtype=torch.bfloat16, gen=g))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        refs, lses, pts = [], [], []
        for bi, n in enumerate(lens):
            kb, vb = dense_rows(kc, bi, n + 1), dense_rows(vc, bi, n + 1)
            assert torch.equal(kb[0, n], kn[bi, 0]) and torch.equal(vb[0, n], vn[bi, 0]), "appended row"
            r, l_, p = _ref_rows(q[bi:bi + 1], kb, vb, dict(causal=True))
            refs.append(r), lses.append(l_), pts.append(p)
        _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))


def test_split_kvcache_auto_under_cuda_graph_replay():
    """flash_attn_with_kvcache(num_splits=0) decode step captured once, replayed with new cache contents, new
    q/new keys and new cache_seqlens (the split count chosen at capture stays; lengths are device values)."""
    b, hkv, hq, d, ps, cap = 2, 8, 32, 128, 16, 4096
    g = torch.Generator(device="cuda").manual_seed(61)
    num_pages = b * cap // ps
    kc = _rand(num_pages, ps, hkv, d, dtype=torch.bfloat16, gen=g)
    vc = _rand(num_pages, ps, hkv, d, dtype=torch.bfloat16, gen=g)
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)).view(b, -1).to(torch.int32).cuda()
    q = _rand(b, 1, hq, d, dtype=torch.bfloat16, gen=g)
    kn = _rand(b, 1, hkv, d, dtype=torch.bfloat16, gen=g)
    vn = _rand(b, 1, hkv, d, dtype=torch.bfloat16, gen=g)
    seqlens = torch.tensor([10, 3000], dtype=torch.int32, device="cuda")

    def step():
        return fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, page_table=table, causal=True,
                                          num_splits=0, return_softmax_lse=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for lens in ([4000, 0], [1, 4095]):
        for t in (kc, vc, q, kn, vn):
            t.copy_(_rand(*t.shape, dtype=torch.bfloat16, gen=g))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        refs, lses, pts = [], [], []
        for bi, n in enumerate(lens):
            pos = torch.arange(n + 1, device="cuda")
            kb = kc[table[bi].long()[pos // ps], pos % ps][None]
            vb = vc[table[bi].long()[pos // ps], pos % ps][None]
            r, l_, p = _ref_rows(q[bi:bi + 1], kb, vb, dict(causal=True))
            refs.append(r), lses.append(l_), pts.append(p)
        _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))
