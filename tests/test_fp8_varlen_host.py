"""The FP8 varlen / KV-cache entry points on the CPU (dispatch_fp8_varlen.py): how each call maps onto the kernel's
packed rows (the device check and the launch stubbed), the append into an e4m3 cache, and every refusal."""

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import dispatch_fp8 as F8

E4 = torch.float8_e4m3fn


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(E4)


@pytest.fixture
def launches(monkeypatch):
    """Stub the device check and the launch; each launch's arguments are recorded, and its lse holds
    1000 * head + packed row so the caller's layout can be checked."""
    calls = []

    def fake_run(q, k, v, cu_q, cu_k, used_k, max_q, descales, **kw):
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q.clone(), cu_k=None if cu_k is None else cu_k.clone(),
                          used_k=used_k.clone(), max_q=max_q, descales=descales, **kw))
        total_q, hq = q.shape[1], q.shape[2]
        out = torch.arange(total_q, dtype=torch.float32).view(1, total_q, 1, 1).expand(1, total_q, hq, v.shape[3])
        lse = (1000 * torch.arange(hq).view(1, hq, 1) + torch.arange(total_q).view(1, 1, total_q)).float()
        return out.to(kw["out_dtype"]).contiguous(), lse

    monkeypatch.setattr(F8, "require_cuda", lambda q, k, v: None)
    monkeypatch.setattr(F8, "run_fp8_packed", fake_run)
    return calls


def test_packed_q_and_k_pass_their_offsets_and_lengths(launches):
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    q, k, v = _rand(10, 4, 64), _rand(20, 2, 64, seed=1), _rand(20, 2, 64, seed=2)
    kd = torch.full((3, 2), 0.5)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                         k_descale=kd, causal=True, window_size=(8, None), return_lse=True)
    (c,) = launches
    assert c["q"].shape == (1, 10, 4, 64) and c["q"].data_ptr() == q.data_ptr()
    assert c["k"].shape == (1, 20, 2, 64) and c["k"].data_ptr() == k.data_ptr()
    assert torch.equal(c["cu_q"], cu_q) and torch.equal(c["cu_k"], cu_k)
    assert c["used_k"].tolist() == [5, 4, 11]  # cu_seqlens_k's differences
    assert c["max_q"] == 7 and c["causal"] is True and c["window_size"] == (8, None)
    assert torch.equal(c["descales"][1], kd) and torch.equal(c["descales"][0], torch.ones(3, 2))
    assert out.shape == (10, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (4, 10)
    assert lse[2, 7].item() == 2007


def test_seqused_k_and_a_missing_max_seqlen_q(launches):
    cu_q = torch.tensor([0, 2, 9], dtype=torch.int32)
    used = torch.tensor([1, 0], dtype=torch.int32)
    q, k, v = _rand(9, 2, 128), _rand(2, 16, 2, 128), _rand(2, 16, 2, 128)
    fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used, out_dtype=torch.float16)
    (c,) = launches
    assert c["max_q"] == 7  # read once from cu_seqlens_q (the documented read)
    assert c["cu_k"].tolist() == [0, 16, 32] and c["k"].shape == (1, 32, 2, 128)  # dense k/v as packed rows
    assert torch.equal(c["used_k"], used) and c["out_dtype"] == torch.float16


def test_dense_q_comes_back_in_its_layout(launches):
    q, k, v = _rand(3, 5, 4, 64), _rand(30, 2, 64), _rand(30, 2, 64)
    cu_k = torch.tensor([0, 10, 20, 30], dtype=torch.int32)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_k=cu_k, return_lse=True)
    (c,) = launches
    assert c["cu_q"].tolist() == [0, 5, 10, 15] and c["max_q"] == 5
    assert out.shape == (3, 5, 4, 64) and lse.shape == (3, 4, 5)
    assert out[2, 4, 0, 0].item() == 14 and lse[2, 3, 4].item() == 3014  # sequence 2, row 4 = packed row 14


@pytest.mark.parametrize("kw, exc, match", [
    (dict(seqused_q=torch.tensor([1, 1], dtype=torch.int32)), NotImplementedError, "seqused_q"),
    (dict(page_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "page_table cannot be combined with cu_seqlens_k"),  # served with seqused_k: tests/test_fp8_paged_host.py
    (dict(softcap=-3.0), ValueError, "softcap must be a finite number >= 0"),  # softcap itself is served
    (dict(num_splits=4.0), ValueError, "num_splits must be an int"),
    (dict(num_splits=True), ValueError, "num_splits must be an int"),
    (dict(pack_gqa="yes"), ValueError, "pack_gqa must be None, True or False"),
    (dict(debug_checks=True), NotImplementedError, "debug_checks"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4])), ValueError, "int32"),
    (dict(cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32)), ValueError, r"\(2, 2\)"),  # descales: batch 1
    (dict(k_descale=torch.ones(2, 2, dtype=torch.float16)), ValueError, "float32"),
    (dict(seqused_k=torch.tensor([1], dtype=torch.int32)), ValueError, r"shape \(2,\)"),
])
def test_varlen_refusals_name_the_argument(launches, kw, exc, match):
    q, k, v = _rand(4, 2, 64), _rand(6, 2, 64), _rand(6, 2, 64)
    args = dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32), q_descale=torch.ones(2, 2))
    args.update(kw)
    with pytest.raises(exc, match=match):
        fa.flash_attn_varlen_func(q, k, v, **args)
    assert not launches


def test_varlen_grad_e5m2_and_a_bf16_query_raise():
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q, k, v = _rand(2, 2, 64), _rand(2, 2, 64), _rand(2, 2, 64)
    with pytest.raises(ValueError, match="inference only"):
        fa.flash_attn_varlen_func(q.clone().requires_grad_(), k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(NotImplementedError, match="e5m2"):
        fa.flash_attn_varlen_func(q, k.float().to(torch.float8_e5m2), v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="e4m3 q over a bf16/fp16 cache"):
        fa.flash_attn_varlen_func(q, k.float().bfloat16(), v.float().bfloat16(), cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="CUDA tensors"):  # everything else right: the CPU device
        fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_kvcache_appends_e4m3_keys_and_reads_the_first_rows(launches):
    k_cache, v_cache = _rand(3, 32, 2, 64, seed=1), _rand(3, 32, 2, 64, seed=2)  # one spare cache row
    before = k_cache.view(torch.uint8).clone()
    q, k_new, v_new = _rand(2, 3, 4, 64), _rand(2, 3, 2, 64, seed=3), _rand(2, 3, 2, 64, seed=4)
    seqlens = torch.tensor([5, 20], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                         k_descale=torch.ones(2, 2), return_softmax_lse=True)
    (c,) = launches
    ku8 = k_cache.view(torch.uint8)
    k_u8 = k_new.view(torch.uint8)
    assert torch.equal(ku8[0, 5:8], k_u8[0]) and torch.equal(ku8[1, 20:23], k_u8[1])
    assert torch.equal(v_cache.view(torch.uint8)[1, 20:23], v_new.view(torch.uint8)[1])
    untouched = torch.ones(3, 32, dtype=torch.bool)
    untouched[0, 5:8] = untouched[1, 20:23] = False
    assert torch.equal(ku8[untouched], before[untouched])
    assert c["k"].shape == (1, 64, 2, 64) and c["k"].data_ptr() == k_cache.data_ptr()  # rows 0, 1: a view
    assert c["cu_k"].tolist() == [0, 32, 64] and c["used_k"].tolist() == [8, 23]
    assert c["cu_q"].tolist() == [0, 3, 6] and c["max_q"] == 3 and c["causal"] is True
    assert out.shape == (2, 3, 4, 64) and lse.shape == (2, 4, 3)


def test_kvcache_without_cache_seqlens_reads_the_whole_cache(launches):
    q, kc, vc = _rand(2, 1, 2, 128), _rand(2, 16, 1, 128), _rand(2, 16, 1, 128)
    out = fa.flash_attn_with_kvcache(q, kc, vc)
    assert launches[0]["used_k"].tolist() == [16, 16] and out.shape == (2, 1, 2, 128)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), NotImplementedError, "cache_batch_idx"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),  # softcap is served
    (dict(num_splits=3.0), ValueError, "num_splits must be an int"),
    (dict(pack_gqa=1), ValueError, "pack_gqa must be None, True or False"),
    (dict(k=_rand(2, 1, 2, 64), v=_rand(2, 1, 2, 64), cache_seqlens=1, num_splits=None, pack_gqa="x"), ValueError,
     "pack_gqa must be"),
    (dict(k=_rand(2, 1, 2, 64).float(), v=_rand(2, 1, 2, 64).float(),
          cache_seqlens=1), ValueError, "appending into a float8_e4m3fn cache"),  # fp32: bf16/fp16 are quantized
    (dict(k=_rand(2, 1, 2, 64), v=_rand(2, 1, 2, 64)), ValueError, "cache_seqlens is required"),
    (dict(cache_seqlens=40), ValueError, "does not fit"),
    (dict(v_descale=torch.ones(2, 4)), ValueError, r"\(2, 2\)"),
])
def test_kvcache_refusals_name_the_argument(launches, kw, exc, match):
    q, kc, vc = _rand(2, 1, 4, 64), _rand(2, 16, 2, 64), _rand(2, 16, 2, 64)
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(q, kc, vc, **kw)
    assert not launches


def test_kvcache_e4m3_query_over_a_bf16_cache_small_cache_and_grad_raise(launches):
    q, kc, vc = _rand(2, 1, 4, 64), _rand(2, 16, 2, 64), _rand(2, 16, 2, 64)
    with pytest.raises(ValueError, match="e4m3 q over a bf16/fp16 cache is not served"):
        fa.flash_attn_with_kvcache(q, kc.float().bfloat16(), vc.float().bfloat16())
    with pytest.raises(ValueError, match="1 rows for a batch of 2"):
        fa.flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="inference-only"):
        fa.flash_attn_with_kvcache(q.clone().requires_grad_(), kc, vc)
    with pytest.raises(ValueError, match="batch stride"):  # a cache that is not rows of one tensor is not copied
        kt, vt = (_rand(16, 2, 2, 64).permute(1, 0, 2, 3) for _ in range(2))  # batch stride 128, row stride 256
        fa.flash_attn_with_kvcache(q, kt, vt)
    assert not launches


def test_split_and_pack_arguments_reach_the_launch(launches):
    """num_splits / pack_gqa / max_seqlen_k go through to run_fp8_packed with the bf16 path's defaults: varlen None
    -> splitkv.default_for_call (1 below AUTO_MIN_KEYS keys), the cache call 0 (automatic), a given int as is."""
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    q, k, v = _rand(4, 4, 64), _rand(6, 2, 64), _rand(6, 2, 64)
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=3)
    fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=2, num_splits=5,
                              pack_gqa=True)
    a, b = launches
    assert (a["num_splits"], a["pack_gqa"], a["max_seqlen_k"], a["rows_covered"]) == (1, None, 3, False)
    assert (b["num_splits"], b["pack_gqa"], b["max_seqlen_k"], b["rows_covered"]) == (5, True, None, False)
    launches.clear()
    qd, kc, vc = _rand(2, 1, 4, 64), _rand(2, 16, 2, 64), _rand(2, 16, 2, 64)
    fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=3)
    fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=3, num_splits=1, pack_gqa=False)
    a, b = launches
    assert (a["num_splits"], a["pack_gqa"], a["max_seqlen_k"], a["rows_covered"]) == (0, None, 16, True)
    assert (b["num_splits"], b["pack_gqa"]) == (1, False)


@pytest.mark.parametrize("pack_gqa, hq, hkv, sq, expect", [
    (None, 32, 8, 1, 4), (None, 32, 8, 32, 4), (None, 32, 8, 33, 1),  # packs while Sq * 2 <= the 64-row tile
    (None, 8, 8, 1, 1), (True, 32, 8, 500, 4), (False, 32, 8, 1, 1), (True, 4, 4, 1, 1),
])
def test_fp8_pack_follows_the_bf16_rule(pack_gqa, hq, hkv, sq, expect):
    assert F8.fp8_pack(pack_gqa, hq, hkv, sq) == expect


def test_fp8_splits_forced_and_refused():
    dev = torch.device("cpu")
    assert F8.fp8_splits(1, batch=8, ctas=64, max_seqlen_k=8192, dv=128, device=dev, caps=None) == 1
    assert F8.fp8_splits(7, batch=8, ctas=64, max_seqlen_k=8192, dv=128, device=dev, caps=None) == 7
    with pytest.raises(ValueError, match="257"):  # over the combine's limit, named
        F8.fp8_splits(257, batch=1, ctas=64, max_seqlen_k=8192, dv=128, device=dev, caps=None)


def test_fp8_automatic_splits_count_one_warp_ctas_as_a_quarter(monkeypatch):
    from flash_attn_4_sm120 import splitkv

    monkeypatch.setattr(splitkv, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    # issue 34's B=8 KV 8K decode at Hq/Hkv 32/8: 64 CTAs (one per (sequence, KV head)), 128 KV tiles
    four = F8.fp8_splits(0, batch=8, ctas=64, max_seqlen_k=8192, dv=128, device=dev, caps=None, num_warps=4)
    one = F8.fp8_splits(0, batch=8, ctas=64, max_seqlen_k=8192, dv=128, device=dev, caps=None, num_warps=1)
    assert four == 2  # 128 four-warp CTAs: one wave
    assert one == 8  # 512 one-warp CTAs: about four per SM
    # B=64 KV 2K: 512 one-warp CTAs already hold ~4 per SM (128 four-warp equivalents fill 80% of 132): no split
    assert F8.fp8_splits(0, batch=64, ctas=512, max_seqlen_k=2048, dv=128, device=dev, caps=None, num_warps=1) == 1
    # the key-split decode tile (two warps on one row block) counts as its one row block: the same splits
    kw = dict(device=dev, caps=None, num_warps=2, kv_warps=2)
    assert F8.fp8_splits(0, batch=8, ctas=64, max_seqlen_k=8192, dv=128, **kw) == 8
    assert F8.fp8_splits(0, batch=64, ctas=512, max_seqlen_k=2048, dv=128, **kw) == 1
