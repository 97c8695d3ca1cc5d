"""The default split rule (num_splits=None with splitkv.DEFAULT_SPLITS_AUTO on) and the split path's host memos, on
the CPU with the device, the compiler and the launches stubbed (tests/plan_grid.py): which calls split, that the KV
walk is read from shapes only, that one workspace allocation holds both partials in the layouts the kernels took
before, and that the per-shape memos give what a fresh plan gives while the KV length grows."""

import sys
from pathlib import Path

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import combine as CB, plan as P, splitkv as SK
from flash_attn_4_sm120.config_combine import combine_split_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_grid  # noqa: E402

_INFER = dict(needs_grad=False, dropout=False, block_sparse=False, compiling=False, capturing=False,
              kv_extent_static=True)
MIN = SK.AUTO_MIN_KEYS


@pytest.fixture
def auto_on(monkeypatch):
    monkeypatch.setattr(SK, "DEFAULT_SPLITS_AUTO", True)


# ---- the rule ---------------------------------------------------------------------------------------------------
def test_short_kv_walk_is_not_split_by_default(auto_on):
    assert SK.default_num_splits(**_INFER, kv_walk=MIN - 1) == 1
    assert SK.default_num_splits(**_INFER, kv_walk=MIN) == 0
    assert SK.default_num_splits(**_INFER, kv_walk=4 * MIN) == 0
    assert SK.default_num_splits(**_INFER, kv_walk=None) == 0  # unknown: auto_num_splits decides alone


def test_rule_does_not_override_the_other_refusals(auto_on):
    for flag in ("needs_grad", "dropout", "block_sparse", "compiling"):
        assert SK.default_num_splits(**dict(_INFER, **{flag: True}), kv_walk=4 * MIN) == 1
    assert SK.default_num_splits(**dict(_INFER, capturing=True, kv_extent_static=False), kv_walk=4 * MIN) == 1


def test_threshold_sits_between_the_measured_contexts():
    """The probe (split_generate_probe_h200_s31.jsonl) measured a split loss at 4K keys and a win at 16K."""
    assert 4096 < MIN <= 16384


def test_kv_walk_from_shapes():
    q = torch.zeros(1, 1, 32, 128)
    k = torch.zeros(1, 8, 5000, 128).transpose(1, 2)  # transformers' cache layout, viewed (B, L, H, D)
    assert SK.default_kv_walk(q, k) == 5000
    assert SK.default_kv_walk(q, k, causal=True, window_size=(None, None)) == 5000
    assert SK.default_kv_walk(q, k, causal=True, window_size=(100, 100)) == 101  # right bound 0 under causal
    assert SK.default_kv_walk(q, k, window_size=(100, None)) == 5000  # unbounded right: the whole row
    assert SK.default_kv_walk(q, k, window_size=(-1, -1)) == 5000
    pages = torch.zeros(40, 64, 8, 128)
    table = torch.zeros(2, 30, dtype=torch.int32)
    assert SK.default_kv_walk(q, pages, page_table=table) == 30 * 64
    assert SK.default_kv_walk(q, pages, page_table=table, max_seqlen_k=700) == 700
    cu = torch.zeros(3, dtype=torch.int32)
    assert SK.default_kv_walk(q, k, cu_seqlens_k=cu) is None  # needs a device value: not read
    assert SK.default_kv_walk(q, k, cu_seqlens_k=cu, max_seqlen_k=9000) == 9000


@pytest.mark.parametrize("bad", [None, 3, "k", torch.zeros(())])
def test_kv_walk_of_a_malformed_argument_is_unknown(bad):
    assert SK.default_kv_walk(torch.zeros(1, 1, 4, 64), bad) is None


def test_kv_walk_never_reads_a_tensor_length():
    """A max_seqlen_k tensor (refused later by validation) is not turned into an int here: on a GPU that would be
    a device->host sync."""
    class Tripwire(int):
        def __index__(self):
            raise AssertionError("read")

        __int__ = __index__

    q, k = torch.zeros(1, 1, 4, 64), torch.zeros(1, 9000, 4, 64)
    assert SK.default_kv_walk(q, k, max_seqlen_k=torch.tensor(9000)) is None
    assert SK.default_kv_walk(q, k, max_seqlen_k=Tripwire(9000)) is None
    assert SK.default_kv_walk(q, k, max_seqlen_k=True) is None


# ---- through the public functions (stubbed device, 188 SMs) -----------------------------------------------------
def _decode(L, **kw):
    calls = []
    with plan_grid.stubbed(True, calls):
        q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
        k = torch.zeros(1, 8, L, 128, dtype=torch.bfloat16).transpose(1, 2)
        fa.flash_attn_func(q, k, k, causal=True, **kw)
    return calls


def _splits(calls):
    """(split count, launches) of one call: the forward's num_batch is batch * splits (batch 1 here)."""
    return calls[0][1]["num_batch"], len(calls)


def test_default_splits_a_long_decode_and_not_a_short_one(auto_on):
    n, launches = _splits(_decode(2 * MIN))
    assert n > 1 and launches == 2  # forward + combine
    assert _splits(_decode(MIN // 2)) == (1, 1)


def test_default_off_never_splits(monkeypatch):
    monkeypatch.setattr(SK, "DEFAULT_SPLITS_AUTO", False)
    assert _splits(_decode(4 * MIN)) == (1, 1)


def test_explicit_automatic_and_forced_counts_ignore_the_rule(auto_on):
    assert _splits(_decode(MIN // 2, num_splits=0))[0] > 1
    assert _splits(_decode(MIN // 2, num_splits=3)) == (3, 2)
    assert _splits(_decode(4 * MIN, num_splits=1)) == (1, 1)


def test_window_bounds_the_walk(auto_on):
    assert _splits(_decode(4 * MIN, window_size=(256, 0))) == (1, 1)


# ---- one workspace allocation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("splits", [2, 13, 64])
def test_partials_are_views_of_one_allocation_in_the_old_layouts(varlen, splits):
    out = torch.empty(37, 6, 64) if varlen else torch.empty(2, 5, 6, 64)
    lse = torch.empty(6, 37) if varlen else torch.empty(2, 6, 5)
    o, lp, oc, lc = SK.partials(out, lse, splits, varlen)
    # the layouts the forward kernel got from two torch.empty calls before
    o_old = torch.empty((splits, *out.shape))
    l_old = torch.empty((splits, *lse.shape))
    assert (o.shape, o.stride(), o.dtype) == (o_old.shape, o_old.stride(), torch.float32)
    assert (lp.shape, lp.stride(), lp.dtype) == (l_old.shape, l_old.stride(), torch.float32)
    # and the combine's views of them, as combine_into built them before
    oc_old, lc_old = (o_old.unsqueeze(1), l_old.transpose(1, 2).unsqueeze(1)) if varlen else \
        (o_old, l_old.transpose(2, 3))
    assert (oc.shape, oc.stride()) == (oc_old.shape, oc_old.stride())
    assert (lc.shape, lc.stride()) == (lc_old.shape, lc_old.stride())
    # one storage: o at offset 0, the LSE right after it, 16-byte aligned, no overlap
    assert o.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr() == lc.untyped_storage().data_ptr()
    assert o.storage_offset() == 0 and lp.storage_offset() == o.numel() and lp.storage_offset() % 4 == 0
    assert o.untyped_storage().nbytes() == 4 * (o.numel() + lp.numel())
    # the combine views alias the kernel's views element for element
    o.copy_(torch.arange(o.numel(), dtype=torch.float32).view(o.shape))
    lp.copy_(-torch.arange(lp.numel(), dtype=torch.float32).view(lp.shape))
    assert torch.equal(oc, o.unsqueeze(1) if varlen else o)
    assert torch.equal(lc, lp.transpose(1, 2).unsqueeze(1) if varlen else lp.transpose(2, 3))


# ---- memos: equal to a fresh computation while the KV length grows -----------------------------------------------
def _kvcache_calls(lengths, fresh: bool, num_splits=0):
    calls, out = [], []
    with plan_grid.stubbed(True, calls):
        q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
        cache = torch.zeros(1, max(lengths), 8, 128, dtype=torch.bfloat16)
        for L in lengths:
            if fresh:
                P.clear()
                CB._KERNELS.clear()
            calls.clear()
            fa.flash_attn_with_kvcache(q, cache[:, :L], cache[:, :L], num_splits=num_splits)
            out.append([(repr(fn), {k: v for k, v in vals.items() if not isinstance(v, torch.Tensor)})
                        for fn, vals in calls])
    return out


def test_memoised_launches_equal_fresh_ones_as_the_kv_grows():
    lengths = [64, 65, 127, 128, 129, 1000, 4095, 4096, 4097, 16384, 40000, 300]
    memo, fresh = _kvcache_calls(lengths, False), _kvcache_calls(lengths, True)
    assert memo == fresh
    counts = {c[0][1]["num_batch"] for c in memo}
    assert len(counts) > 2  # the split count follows the length: the memo does not freeze it


def test_combine_launcher_memo_follows_the_split_groups():
    """The memo keys on the split count: counts on either side of combine_split_groups' threshold get their own
    configuration (a split_groups change), as a fresh lookup gives."""
    rows, sms = 32, plan_grid.SMS
    counts = [n for n in range(2, 65) if combine_split_groups(rows, n, 128, sms) > 1]
    lo = [n for n in range(2, 65) if combine_split_groups(rows, n, 128, sms) == 1]
    assert counts and lo
    calls = []
    with plan_grid.stubbed(True, calls):
        q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
        k = torch.zeros(1, 40000, 8, 128, dtype=torch.bfloat16)
        for n in (lo[-1], counts[0], lo[-1]):
            fa.flash_attn_func(q, k, k, num_splits=n)
    groups = [fn.split_groups for fn, vals in calls if "num_rows" in vals]
    assert groups == [1, combine_split_groups(rows, counts[0], 128, sms), 1]


def test_many_shapes_do_not_grow_the_combine_memo_without_bound(monkeypatch):
    monkeypatch.setattr(CB, "_MAX_CALL_KEYS", 8)
    calls = []
    with plan_grid.stubbed(True, calls):
        k = torch.zeros(1, 2000, 2, 64, dtype=torch.bfloat16)
        for sq in range(1, 20):
            fa.flash_attn_func(torch.zeros(1, sq, 2, 64, dtype=torch.bfloat16), k, k, num_splits=3)
        assert len(CB._KERNELS) <= 8 + 2  # the call keys and at most a compiled entry or two
    assert sum(1 for _, vals in calls if "num_rows" in vals) == 19
