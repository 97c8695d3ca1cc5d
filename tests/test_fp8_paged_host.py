"""The paged FP8 (e4m3) KV cache on the CPU: the paged loader's lane/row arithmetic (config_fp8.paged_slot /
paged_slot_row, which kernels/fwd_fp8.py calls on Int32 values), flash_attn_with_kvcache's routing of a page table
(what reaches run_fp8_packed, the appends into pages, every refusal before any write), and run_fp8_packed's paged
launch end to end against the torch model of the kernel's contract (tests/test_fp8_split_host.py: pages looked up
per key, indices clamped to the pool).  The numbers on a GPU: tests/test_fp8_paged_gpu.py."""

import dataclasses

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import config_fp8 as C
from flash_attn_4_sm120 import dispatch_fp8 as F8
from flash_attn_4_sm120.dispatch_fp8_varlen import _table_rows
from flash_attn_4_sm120.fp8_quant import quantize_with_descale
from tests.test_fp8_split_host import model  # noqa: F401  (the kernel and combine modelled in torch, a fixture)
from tests.test_fp8_varlen_host import launches  # noqa: F401  (the stubbed launch, a fixture)

E4 = torch.float8_e4m3fn


def _pool(pages, page_size, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(pages, page_size, hkv, d, generator=g).to(E4) for _ in range(2))


def _table(rows, seed=0, pages=None):
    """A (len(rows), max(rows)) int32 table of distinct, shuffled pages (a real allocator's scatter)."""
    width = max(rows)
    perm = torch.randperm(pages or len(rows) * width, generator=torch.Generator().manual_seed(seed))
    return perm[:len(rows) * width].view(len(rows), width).to(torch.int32)


# ---- the loader's arithmetic: every copy of a tile reads the page of its own row ---------------------------------
@pytest.mark.parametrize("d, warps", [(64, 4), (128, 4), (64, 1), (128, 1), (64, 2), (128, 2)])
def test_each_copy_takes_its_rows_page_from_the_lane_that_looked_it_up(d, warps):
    threads, chunks, tile_n = 32 * warps, d // 16, C.FP8_TILE_N
    slots = tile_n // warps
    per = tile_n * chunks // threads  # copies per thread and tensor
    rows_seen = set()
    for warp in range(warps):
        held = {lane: [(lane + 32 * i) % slots for i in range((slots + 31) // 32)] for lane in range(32)}
        looked = {s for v in held.values() for s in v}
        assert looked == set(range(slots))  # every slot of the warp is looked up by some lane
        for j in range(per):
            regs = set()
            for lane in range(32):
                tidx = 32 * warp + lane
                row = (tidx + threads * j) // chunks  # the row load_kv_rows / copy_paged_row copy
                slot = C.paged_slot(lane, j, chunks)
                assert 0 <= slot < slots
                regs.add(slot // 32)  # which looked-up register: the same for the whole warp (one shuffle)
                # the owning lane (slot % 32) holds that slot in register slot // 32 and it names this row
                assert held[slot % 32][slot // 32] == slot
                assert C.paged_slot_row(slot, warp, chunks, threads) == row
                rows_seen.add(row)
            assert len(regs) == 1
    assert rows_seen == set(range(tile_n))  # the tile is covered


def test_paged_configs_are_varlen_and_in_the_worklist():
    cfgs = C.all_configs()
    paged = [c for c in cfgs if c.paged]
    # 192: bf16/fp16-query forms (q_dtype); the softcap forms of the gate's subset besides (their twins are here)
    assert len([c for c in paged if not c.softcap]) == 144 + 192 and all(c.varlen for c in paged)
    # one paged twin per varlen configuration, and nothing else
    assert {dataclasses.replace(c, paged=False) for c in paged} == {c for c in cfgs if c.varlen and not c.paged}
    with pytest.raises(ValueError, match="paged=True needs varlen=True"):
        C.can_implement(C.Fp8FwdConfig(128, 128, False, paged=True))
    for split in (False, True):
        for rows in (4, 64):
            cfg = C.select_config(128, 128, True, "bf16", varlen=True, pack_gqa=True, split=split, rows=rows,
                                  paged=True)
            assert cfg.paged and cfg in cfgs and cfg.name().endswith(
                ("paged_fp32" if split else "paged_bf16") + ("_16x64_w2_s2_kw2" if rows == 4 else "_64x64_w4_s2"))


# ---- flash_attn_with_kvcache: the routing -------------------------------------------------------------------------
@pytest.mark.parametrize("alias", ["page_table", "block_table"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, E4])
def test_a_paged_cache_reaches_the_launch_as_pools_and_table(launches, alias, q_dtype):
    kc, vc = _pool(12, 16)
    table = _table([3, 3], pages=12)
    q = torch.randn(2, 1, 8, 64).to(q_dtype)
    seqlens = torch.tensor([5, 40], dtype=torch.int32)
    kd = torch.full((2, 2), 0.5)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_descale=kd, causal=True,
                                          return_softmax_lse=True, **{alias: table})
    (c,) = launches
    assert c["k"] is kc and c["v"] is vc and c["cu_k"] is None  # the pools, never copied or flattened
    assert torch.equal(c["page_table"], table) and c["used_k"].tolist() == [5, 40]
    assert c["max_seqlen_k"] == 48 and c["cu_q"].tolist() == [0, 1, 2] and c["max_q"] == 1
    assert torch.equal(c["descales"][1], kd) and c["causal"] is True
    assert out.shape == (2, 1, 8, 64) and lse.shape == (2, 8, 1)
    assert out.dtype == (torch.bfloat16 if q_dtype == E4 else q_dtype)


def test_without_cache_seqlens_every_key_of_the_table_is_used(launches):
    kc, vc = _pool(6, 7)
    fa.flash_attn_with_kvcache(torch.randn(3, 2, 4, 64).bfloat16(), kc, vc, page_table=_table([2, 2, 2], pages=6))
    assert launches[0]["used_k"].tolist() == [14, 14, 14] and launches[0]["max_seqlen_k"] == 14


@pytest.mark.parametrize("new_dtype", [E4, torch.bfloat16])
def test_appends_cross_page_boundaries_into_the_tables_pages(launches, new_dtype):
    page_size, b, hkv = 4, 2, 2
    kc, vc = _pool(10, page_size, hkv)
    before_k, before_v = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    table = torch.tensor([[7, 2, 9], [0, 5, 1]], dtype=torch.int32)
    seqlens = torch.tensor([3, 6], dtype=torch.int32)  # entry 0 writes positions 3..5 (pages 7, 2), entry 1 6..8
    g = torch.Generator().manual_seed(3)
    k_new, v_new = ((torch.randn(b, 3, hkv, 64, generator=g) * 2).to(new_dtype) for _ in range(2))
    kd, vd = torch.full((b, hkv), 0.25), torch.full((b, hkv), 2.0)
    fa.flash_attn_with_kvcache(torch.randn(b, 3, 4, 64).bfloat16(), kc, vc, k_new, v_new, cache_seqlens=seqlens,
                               page_table=table, k_descale=kd, v_descale=vd, causal=True)
    (c,) = launches
    assert c["used_k"].tolist() == [6, 9]
    k8, v8 = ((x if x.dtype == E4 else quantize_with_descale(x, d)) for x, d in ((k_new, kd), (v_new, vd)))
    written = torch.zeros(10, page_size, dtype=torch.bool)
    for i in range(b):
        for n in range(3):
            pos = int(seqlens[i]) + n
            page, row = int(table[i, pos // page_size]), pos % page_size
            written[page, row] = True
            assert torch.equal(kc[page, row].view(torch.uint8), k8[i, n].view(torch.uint8))
            assert torch.equal(vc[page, row].view(torch.uint8), v8[i, n].view(torch.uint8))
    assert torch.equal(kc.view(torch.uint8)[~written], before_k[~written])  # nothing else moved
    assert torch.equal(vc.view(torch.uint8)[~written], before_v[~written])


@pytest.mark.parametrize("kw, exc, match", [
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "int32"),
    (dict(page_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "3 rows but the batch is 2"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), block_table=torch.zeros(2, 2, dtype=torch.int32)),
     ValueError, "block_table"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)),
     NotImplementedError, "cache_batch_idx"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), softcap=-3.0), ValueError, "softcap must be a finite"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), k=torch.randn(2, 1, 2, 64).bfloat16(),
          v=torch.randn(2, 1, 2, 64).bfloat16(), cache_seqlens=32), ValueError, "does not fit"),  # capacity 2 x 16
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), k=torch.randn(2, 1, 2, 64).bfloat16(),
          v=torch.randn(2, 1, 2, 64).bfloat16(), cache_seqlens=1, num_splits=-1.5), ValueError, "num_splits"),
    (dict(page_table=torch.zeros(2, 2, dtype=torch.int32), q_descale=torch.ones(2, 2)), ValueError,
     "q_descale given with a torch.bfloat16 q"),
])
def test_paged_refusals_name_the_argument_and_write_nothing(launches, kw, exc, match):
    kc, vc = _pool(4, 16)
    before = kc.view(torch.uint8).clone()
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 64).bfloat16(), kc, vc, **kw)
    assert not launches and torch.equal(kc.view(torch.uint8), before)


def test_pools_with_different_page_shapes_raise(launches):
    kc, _ = _pool(4, 16)
    _, vc = _pool(4, 8)
    with pytest.raises(ValueError, match="same pages|shapes do not agree"):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 64).bfloat16(), kc, vc,
                                   page_table=torch.zeros(2, 2, dtype=torch.int32))
    assert not launches


def test_a_one_column_table_of_any_stride_gets_a_unit_column_stride_view():
    base = torch.arange(12, dtype=torch.int32).view(4, 3)
    col = base[:, 1:2]  # (4, 1), strides (3, 1): already unit
    assert _table_rows(col) is col
    odd = torch.arange(8, dtype=torch.int32).as_strided((4, 1), (2, 2))
    got = _table_rows(odd)
    assert got.stride() == (2, 1) and torch.equal(got, odd) and got.data_ptr() == odd.data_ptr()


# ---- run_fp8_packed's paged launch against the kernel's contract (modelled in torch) ------------------------------
def _paged_inputs(lens_k, page_size, hq=8, hkv=2, sq=1, seed=0):
    b = len(lens_k)
    width = max(1, -(-max(lens_k) // page_size))
    pages = b * width + 3
    kp, vp = _pool(pages, page_size, hkv, seed=seed)
    table = _table([width] * b, seed=seed, pages=pages)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(1, b * sq, hq, 64, generator=g).to(E4)
    cu_q = torch.arange(b + 1, dtype=torch.int32) * sq
    used = torch.tensor(lens_k, dtype=torch.int32)
    desc = tuple(torch.rand(b, hkv, generator=g) + 0.5 for _ in range(3))
    # the same keys laid out contiguously: sequence i's key j is row j % ps of page table[i, j // ps]
    rows = [table[i].long().repeat_interleave(page_size)[:n] * page_size + torch.arange(n) % page_size
            for i, n in enumerate(lens_k)]
    k_rows, v_rows = (torch.cat([x.view(torch.uint8).flatten(0, 1)[r] for r in rows]).view(E4)[None]
                      for x in (kp, vp))
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    return (q, kp, vp, table, cu_q, used, desc), (q, k_rows, v_rows, cu_q, cu_k, used, desc)


def _run_paged(args, sq, **kw):
    q, kp, vp, table, cu_q, used, desc = args
    return F8.run_fp8_packed(q, kp, vp, cu_q, None, used, sq, desc, softmax_scale=None, causal=False,
                             out_name="bf16", out_dtype=torch.bfloat16, page_table=table, **kw)


def _run_rows(args, sq, **kw):
    q, k, v, cu_q, cu_k, used, desc = args
    return F8.run_fp8_packed(q, k, v, cu_q, cu_k, used, sq, desc, softmax_scale=None, causal=False,
                             out_name="bf16", out_dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_paged_launch_is_the_contiguous_one_on_gathered_rows(model, page_size, splits):
    lens_k = [70, 0, 13, 129]
    paged, rows = _paged_inputs(lens_k, page_size)
    out_p, lse_p = _run_paged(paged, 1, num_splits=splits, max_seqlen_k=129)
    out_c, lse_c = _run_rows(rows, 1, num_splits=splits, max_seqlen_k=129)
    launch = model[0]
    assert launch["cfg"].paged and launch["cu_k"] is None and launch["page_table"] is paged[3]
    assert launch["cfg"].split == (splits > 1) and launch["cfg"].pack_gqa and launch["cfg"].tile_m == 16
    assert launch["left"] == paged[3].shape[1] * page_size  # an unbounded side covers the table's capacity
    assert not model[-1]["cfg"].paged
    torch.testing.assert_close(out_p.float(), out_c.float(), rtol=0, atol=0)
    torch.testing.assert_close(lse_p, lse_c, rtol=0, atol=0)


def test_a_lying_table_and_lengths_are_clamped_to_the_pool(model):
    paged, _ = _paged_inputs([40, 9], 8)
    q, kp, vp, table, cu_q, used, desc = paged
    lying = table.clone()
    lying[0, 1], lying[1, 0] = 10 ** 6, -7  # past the pool and negative: read the last and the first page
    too_long = torch.tensor([10 ** 6, -3], dtype=torch.int32)  # past the table's capacity, negative
    out, lse = _run_paged((q, kp, vp, lying, cu_q, too_long, desc), 1)
    fixed = table.clone()
    fixed[0, 1], fixed[1, 0] = kp.shape[0] - 1, 0
    out_ref, lse_ref = _run_paged((q, kp, vp, fixed, cu_q, torch.tensor([40, 0], dtype=torch.int32), desc), 1)
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)


# ---- flash_attn_varlen_func with a page table ----------------------------------------------------------------------
@pytest.mark.parametrize("varlen_q", [False, True])
def test_varlen_with_a_page_table_reads_the_pools(launches, varlen_q):
    kp, vp = _pool(9, 16)
    table = _table([4, 4], pages=9)
    q = torch.randn(2, 3, 4, 64).to(E4)
    used = torch.tensor([3, 50], dtype=torch.int32)
    kw = dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=3) if varlen_q else {}
    out, _ = fa.flash_attn_varlen_func(q.flatten(0, 1) if varlen_q else q, kp, vp, page_table=table,
                                       seqused_k=used, causal=True, **kw)
    (c,) = launches
    assert c["k"] is kp and c["v"] is vp and c["cu_k"] is None and torch.equal(c["page_table"], table)
    assert c["used_k"].tolist() == [3, 50] and c["max_seqlen_k"] == 64 and c["cu_q"].tolist() == [0, 3, 6]
    assert out.shape == ((6,) if varlen_q else (2, 3)) + (4, 64)
    fa.flash_attn_varlen_func(q, kp, vp, page_table=table)  # no seqused_k: the table's capacity
    assert launches[1]["used_k"].tolist() == [64, 64]


def test_varlen_page_table_refusals(launches):
    kp, vp = _pool(4, 16)
    q = torch.randn(2, 1, 4, 64).to(E4)
    with pytest.raises(ValueError, match="page_table cannot be combined with cu_seqlens_k"):
        fa.flash_attn_varlen_func(q[:, 0], kp, vp, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 1, 2], dtype=torch.int32),
                                  page_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table has 1 rows but the batch is 2"):
        fa.flash_attn_varlen_func(q, kp, vp, page_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="not supported with FP8 inputs"):  # flash_attn_func: not served
        fa.flash_attn_func(q, kp, vp, page_table=torch.zeros(2, 1, dtype=torch.int32))
    assert not launches


def test_the_automatic_split_reads_the_tables_capacity(launches):
    """num_splits=None on the varlen form: splitkv's walk is max_pages x page_size (a long paged cache may split),
    not the page size."""
    kp, vp = _pool(64, 256)
    q = torch.randn(1, 1, 8, 64).to(E4)
    fa.flash_attn_varlen_func(q, kp, vp, page_table=_table([64], pages=64))  # 16384 keys: automatic (0)
    fa.flash_attn_varlen_func(q, kp, vp, page_table=_table([4], pages=64))  # 1024 keys: no split
    assert [c["num_splits"] for c in launches] == [0, 1]
