"""Split-KV forward (num_splits) on a GPU, against the fp32 reference (tests/reference.py), with the bar of
test_fwd_gpu: max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol, LSE within 1e-3.

Covers splits 1, 2, 7, 64 and automatic (0, -1); q_len 1, 5, 16, 300; paged (NaN-filled pools, random page
permutation) and contiguous K/V; GQA 1/4/8; causal, sliding window, softcap, learnable sink (applied in split 0
only); varlen q with empty sequences and rows outside every sequence (O = 0, LSE = -inf after the combine); no
device->host sync. flash_attn_with_kvcache's automatic split under CUDA-graph replay: test_kvcache_gpu.py.
"""

import pytest
import torch

from test_fwd_gpu import _compare
from test_paged_gpu import Paged, _rand, _ref_rows, check_dense_q, check_varlen_q

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")
SPLITS = [1, 2, 7, 64, 0]


def _dense_check(out, lse, q, k, v, **kw):
    refs, lses, pts = zip(*[_ref_rows(q[b:b + 1], k[b:b + 1], v[b:b + 1], kw) for b in range(q.shape[0])])
    _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("sq", [1, 5, 16, 300])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_split_contiguous(num_splits, sq, hq, hkv):
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + hkv)
    q = _rand(2, sq, hq, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(2, 1500, hkv, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(2, 1500, hkv, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    _dense_check(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("sq", [1, 5, 16, 300])
@pytest.mark.parametrize("page_size", [16, 3])
def test_split_paged(num_splits, sq, page_size):
    lens = [0, 2 * page_size, 1000, 61]  # empty, full pages, long, partial
    pg = Paged(lens, page_size, 2, 128, 128, seed=page_size + sq)
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = _rand(len(lens), sq, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         num_splits=num_splits, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True)


@pytest.mark.parametrize("mask", ["none", "causal", "win_64_0", "win_32_16", "causal_left_77"])
@pytest.mark.parametrize("softcap,sink", [(0.0, False), (30.0, True), (0.0, True)])
@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_split_masks_softcap_sink(mask, softcap, sink, num_splits):
    causal = mask.startswith("causal")
    window = {"none": (None, None), "causal": (None, None), "win_64_0": (64, 0), "win_32_16": (32, 16),
              "causal_left_77": (77, None)}[mask]
    lens = [333, 17, 0, 129]
    pg = Paged(lens, 16, 2, 64, 64, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    q = _rand(4, 9, 8, 64, dtype=torch.bfloat16, gen=g) * (3 if softcap else 1)
    s = torch.randn(8, device="cuda", generator=g) * 2 if sink else None
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                         window_size=window, softcap=softcap, learnable_sink=s,
                                         num_splits=num_splits, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=causal, window=window, softcap=softcap, sink=s)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [3, 0])
def test_split_head_dims_and_sink_in_an_empty_first_split(d, num_splits):
    """A window that leaves split 0 empty for late queries: the sink still counts once (split 0 writes LSE =
    sink, O = 0)."""
    g = torch.Generator(device="cuda").manual_seed(d)
    q = _rand(1, 4, 4, d, dtype=torch.bfloat16, gen=g)
    k = _rand(1, 2048, 4, d, dtype=torch.bfloat16, gen=g)
    v = _rand(1, 2048, 4, d, dtype=torch.bfloat16, gen=g)
    s = torch.randn(4, device="cuda", generator=g)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, window_size=(100, 0), learnable_sink=s,
                                  num_splits=num_splits, return_lse=True)
    _dense_check(out, lse, q, k, v, causal=True, window=(100, None), sink=s)


@pytest.mark.parametrize("num_splits", [2, 7, 64, 0])
@pytest.mark.parametrize("paged", [False, True])
def test_split_varlen_empty_sequences_and_unused_rows(num_splits, paged):
    """varlen q with zero-length sequences and rows outside every sequence (before cu_seqlens_q[0], after
    cu_seqlens_q[-1]): those rows are O = 0, LSE = -inf in the combined output."""
    qlens, klens = [5, 0, 1, 16], [700, 50, 0, 300]
    lead, tail = 3, 4
    total = lead + sum(qlens) + tail
    g = torch.Generator(device="cuda").manual_seed(31)
    q = _rand(total, 8, 128, dtype=torch.bfloat16, gen=g)
    cu_q = torch.tensor([lead + sum(qlens[:i]) for i in range(len(qlens) + 1)], dtype=torch.int32, device="cuda")
    pg = Paged(klens, 16, 2, 128, 128, seed=32)
    if paged:
        out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, cu_seqlens_q=cu_q, max_seqlen_q=max(qlens),
                                             seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                             num_splits=num_splits, return_lse=True)
    else:
        kk = torch.cat([pg.k[b, :n] for b, n in enumerate(klens)])
        vv = torch.cat([pg.v[b, :n] for b, n in enumerate(klens)])
        cu_k = torch.tensor([sum(klens[:i]) for i in range(len(klens) + 1)], dtype=torch.int32, device="cuda")
        out, lse = fa.flash_attn_varlen_func(q, kk, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                             max_seqlen_q=max(qlens), max_seqlen_k=max(klens), causal=True,
                                             num_splits=num_splits, return_lse=True)
    inside = slice(lead, lead + sum(qlens))
    for rows in (slice(0, lead), slice(lead + sum(qlens), total)):
        assert torch.equal(out[rows], torch.zeros_like(out[rows])), "unused rows: O = 0"
        assert torch.isneginf(lse[:, rows]).all(), "unused rows: LSE = -inf"
    check_varlen_q(out[inside], lse[:, inside].contiguous(), q[inside], cu_q - lead, pg, causal=True)


@pytest.mark.parametrize("num_splits", [2, 0])
def test_split_seqused_q_rows_past_the_length(num_splits):
    g = torch.Generator(device="cuda").manual_seed(41)
    q = _rand(2, 20, 8, 64, dtype=torch.bfloat16, gen=g)
    k = _rand(2, 900, 2, 64, dtype=torch.bfloat16, gen=g)
    v = _rand(2, 900, 2, 64, dtype=torch.bfloat16, gen=g)
    used_q = torch.tensor([7, 0], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, seqused_q=used_q, max_seqlen_q=20, max_seqlen_k=900,
                                         num_splits=num_splits, return_lse=True)
    assert torch.equal(out[0, 7:], torch.zeros_like(out[0, 7:])) and torch.isneginf(lse[0, :, 7:]).all()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    _dense_check(out[:1, :7], lse[:1, :, :7], q[:1, :7], k[:1], v[:1])


def test_split_matches_unsplit_closely():
    """Same inputs, 1 vs 7 vs auto splits: all within the bar of the reference, and close to each other."""
    g = torch.Generator(device="cuda").manual_seed(51)
    q = _rand(1, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(1, 8192, 8, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(1, 8192, 8, 128, dtype=torch.bfloat16, gen=g)
    outs = [fa.flash_attn_func(q, k, v, num_splits=n, return_lse=True) for n in (1, 7, 0)]
    for out, lse in outs:
        _dense_check(out, lse, q, k, v)
    for out, lse in outs[1:]:
        assert (out.float() - outs[0][0].float()).abs().max().item() < 2e-2
        assert (lse - outs[0][1]).abs().max().item() < 1e-3


def test_split_calls_make_no_host_sync():
    from test_sync_gpu import assert_no_sync

    torch.cuda.synchronize()
    probe = 20_000_000
    torch.cuda._sleep(1000)
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    e.record()
    e.synchronize()
    cycles = int(probe * 300.0 / a.elapsed_time(e))
    pg = Paged([5000, 30], 16, 8, 128, 128, seed=71)
    g = torch.Generator(device="cuda").manual_seed(72)
    q = _rand(2, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    qd = _rand(1, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    kd = _rand(1, 8192, 8, 128, dtype=torch.bfloat16, gen=g)
    assert_no_sync(lambda: fa.flash_attn_with_kvcache(q, pg.kp, pg.vp, cache_seqlens=pg.seqused,
                                                      page_table=pg.table, num_splits=0), cycles, "kvcache auto split")
    assert_no_sync(lambda: fa.flash_attn_func(qd, kd, kd, num_splits=7, return_lse=True), cycles, "dense 7 splits")
    assert_no_sync(lambda: fa.flash_attn_func(qd, kd, kd, num_splits=0), cycles, "dense auto split")


def test_auto_split_count_on_this_gpu():
    """The automatic choice splits a B=1 decode (8 KV heads, 32K keys) and not a batch that fills the GPU."""
    from flash_attn_4_sm120 import splitkv as SK

    sms = SK.sm_count(torch.device("cuda", torch.cuda.current_device()))
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert SK.auto_num_splits(8, 512, sms, 256) > 1
    assert SK.auto_num_splits(64 * 8, 32, sms, 256) == 1


# ---- the default (num_splits=None): automatic for inference calls --------------------------------------------
@pytest.fixture
def split_plans(monkeypatch):
    """Whether each forward plan the calls of a test make is a split one."""
    from flash_attn_4_sm120 import plan as P, splitkv

    monkeypatch.setattr(splitkv, "DEFAULT_SPLITS_AUTO", True)  # the automatic default (as shipped: splitkv.py)
    seen = []
    real = P.get_plan

    def spy(key):
        plan = real(key)
        seen.append(plan.fwd_cfg.split_kv)
        return plan

    monkeypatch.setattr(P, "get_plan", spy)
    return seen


def test_default_splits_a_decode_call_and_matches_the_reference(split_plans):
    g = torch.Generator(device="cuda").manual_seed(81)
    q = _rand(1, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(1, 16384, 8, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(1, 16384, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert any(split_plans), "the default did not split a B=1 decode call"
    _dense_check(out, lse, q, k, v, causal=True)
    split_plans.clear()
    fa.flash_attn_func(q, k, v, causal=True, num_splits=1)
    assert not any(split_plans), "num_splits=1 split"


def test_default_never_splits_a_training_call_or_a_full_grid(split_plans):
    g = torch.Generator(device="cuda").manual_seed(82)
    q = _rand(1, 1, 32, 128, dtype=torch.bfloat16, gen=g).requires_grad_()
    k = _rand(1, 16384, 8, 128, dtype=torch.bfloat16, gen=g)
    fa.flash_attn_func(q, k, k, causal=True)[0].sum().backward()
    qp = _rand(8, 2048, 32, 128, dtype=torch.bfloat16, gen=g)
    kp = _rand(8, 2048, 8, 128, dtype=torch.bfloat16, gen=g)
    fa.flash_attn_func(qp, kp, kp, causal=True)  # prefill: 8 x 32 heads x 16 tiles fill any GPU
    assert split_plans and not any(split_plans)


def test_default_under_capture_with_a_given_max_seqlen_k_does_not_split(split_plans):
    g = torch.Generator(device="cuda").manual_seed(83)
    q = _rand(1, 32, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(16384, 8, 128, dtype=torch.bfloat16, gen=g)
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 16384], dtype=torch.int32, device="cuda")

    def step():
        return fa.flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1,
                                         max_seqlen_k=16384)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    assert any(split_plans), "eager: the default splits this call"
    split_plans.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert split_plans and not any(split_plans), "captured with a given max_seqlen_k: one split"


def test_default_split_calls_make_no_host_sync():
    from test_sync_gpu import assert_no_sync

    torch.cuda.synchronize()
    probe = 20_000_000
    torch.cuda._sleep(1000)
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    e.record()
    e.synchronize()
    cycles = int(probe * 300.0 / a.elapsed_time(e))
    g = torch.Generator(device="cuda").manual_seed(84)
    qd = _rand(1, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    kd = _rand(1, 8192, 8, 128, dtype=torch.bfloat16, gen=g)
    assert_no_sync(lambda: fa.flash_attn_func(qd, kd, kd, causal=True), cycles, "dense default")
