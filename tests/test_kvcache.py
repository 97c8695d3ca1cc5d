"""flash_attn_with_kvcache on the host: its refusals, the checks of the new keys and cache_seqlens, the append's
positions and how each cache layout is handed to the forward (no GPU needed: all of this runs before a launch).
The GPU side (attention over the appended cache, CUDA-graph replay): tests/test_kvcache_gpu.py."""

import inspect

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import interface, validate

CPU = torch.device("cpu")


def _pool(num_pages=6, page_size=16, hkv=2, d=64, dv=64):
    return torch.zeros(num_pages, page_size, hkv, d), torch.zeros(num_pages, page_size, hkv, dv)


def _table(batch=2, pages=3, dtype=torch.int32):
    return torch.zeros(batch, pages, dtype=dtype)


@pytest.fixture
def cpu_tensors(monkeypatch):
    """Lets CPU tensors through the fp16/bf16 CUDA tensor check, so the checks after it can be reached here."""
    monkeypatch.setattr(validate, "check_tensor", lambda *args, **kwargs: None)


@pytest.fixture
def forward(monkeypatch, cpu_tensors):
    """Records what flash_attn_with_kvcache hands to the forward instead of launching it."""
    seen = {}

    def fake(q, k, v, sink, return_lse, kw):
        seen.update(kw, q=q, k=k, v=v)
        return torch.full_like(q, 2.0), torch.full((1,), 3.0)

    monkeypatch.setattr(interface, "_attention", fake)
    return seen


@pytest.mark.parametrize("kw,exc,needle", [
    (dict(rotary_cos=torch.zeros(1)), NotImplementedError, "rotary"),
    (dict(rotary_sin=torch.zeros(1)), NotImplementedError, "rotary"),
    (dict(alibi_slopes=torch.zeros(4)), NotImplementedError, "alibi_slopes"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError, "cache_leftpad"),
    (dict(attention_chunk=128), NotImplementedError, "attention_chunk"),
    (dict(sm_margin=4), NotImplementedError, "sm_margin"),
    (dict(cu_seqlens_k_new=torch.zeros(3, dtype=torch.int32)), NotImplementedError, "cu_seqlens_k_new"),
    (dict(scheduler_metadata=torch.zeros(1, dtype=torch.int32)), NotImplementedError, "scheduler_metadata"),
    (dict(qv=torch.zeros(2, 1, 4, 64)), NotImplementedError, "qv"),
    # descales route the call to the FP8 path, which names them as given with non-e4m3 inputs (flash_attn_func's rule)
    (dict(q_descale=torch.ones(1)), ValueError, "q_descale"),
    (dict(page_table=_table(), block_table=_table()), ValueError, "not both"),
    (dict(page_table=_table(), cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError, "cache_batch_idx"),
])
def test_kvcache_rejects(kw, exc, needle):
    q = torch.zeros(2, 1, 4, 64)
    k, v = _pool()
    with pytest.raises(exc) as info:
        fa.flash_attn_with_kvcache(q, k, v, **kw)
    assert needle in str(info.value), str(info.value)


def test_kvcache_append_with_varlen_q_is_refused(monkeypatch):
    """New k/v with cu_seqlens_q: NotImplementedError naming both (the tensor checks, which need CUDA tensors, are
    stubbed out here; the refusal comes after them and before anything is written or launched)."""
    from flash_attn_4_sm120 import interface

    monkeypatch.setattr(interface.V, "check_tensor", lambda *args, **kwargs: None)
    q = torch.zeros(3, 4, 64)
    kc, vc = torch.zeros(2, 32, 2, 64), torch.zeros(2, 32, 2, 64)
    new = torch.zeros(2, 1, 2, 64)
    with pytest.raises(NotImplementedError, match=r"appending k/v with cu_seqlens_q \(varlen q\)"):
        fa.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=1,
                                   cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32), max_seqlen_q=2)
    assert kc.count_nonzero() == 0 and vc.count_nonzero() == 0


def test_kvcache_new_kv_and_cache_seqlens_checks():
    from flash_attn_4_sm120 import kvcache as KV

    kc, vc = torch.zeros(2, 32, 2, 64), torch.zeros(2, 32, 2, 64)
    with pytest.raises(ValueError, match="together"):
        KV.check_new_kv(torch.zeros(2, 1, 2, 64), None, kc, vc, 2, CPU)
    with pytest.raises(ValueError, match="int or an int32"):
        KV.check_cache_seqlens(3.0, 2, 32, 1, CPU)
    with pytest.raises(ValueError, match="int or an int32"):
        KV.check_cache_seqlens(True, 2, 32, 1, CPU)
    with pytest.raises(ValueError, match="does not fit"):
        KV.check_cache_seqlens(32, 2, 32, 1, CPU)
    with pytest.raises(ValueError, match="does not fit"):
        KV.check_cache_seqlens(-1, 2, 32, 0, CPU)
    with pytest.raises(ValueError, match="int32"):
        KV.check_cache_seqlens(torch.zeros(2, dtype=torch.int64), 2, 32, 1, CPU)
    got = KV.check_cache_seqlens(5, 2, 32, 1, CPU)
    assert got.dtype == torch.int32 and got.tolist() == [5, 5]


def test_kvcache_append_contiguous_and_paged_on_cpu():
    """The append itself is plain torch indexing: check its positions on the CPU (page crossing included)."""
    from flash_attn_4_sm120 import kvcache as KV

    k = torch.arange(2 * 3 * 1 * 1, dtype=torch.float32).view(2, 3, 1, 1) + 1
    # contiguous with cache_batch_idx
    kc, vc = torch.zeros(3, 8, 1, 1), torch.zeros(3, 8, 1, 1)
    KV.append(kc, vc, k, -k, torch.tensor([2, 6 - 1], dtype=torch.int32), None, torch.tensor([2, 0]))
    assert kc[2, 2:5, 0, 0].tolist() == [1, 2, 3] and kc[0, 5:8, 0, 0].tolist() == [4, 5, 6]
    assert vc[2, 2:5, 0, 0].tolist() == [-1, -2, -3] and kc.count_nonzero() == 6
    # paged, page size 2: sequence 0 at 3 crosses from its 2nd page (table col 1) into its 3rd (col 2)
    kp, vp = torch.zeros(6, 2, 1, 1), torch.zeros(6, 2, 1, 1)
    table = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32)
    KV.append(kp, vp, k, k, torch.tensor([3, 0], dtype=torch.int32), table, None)
    assert kp[1, 1, 0, 0] == 1 and kp[3, 0, 0, 0] == 2 and kp[3, 1, 0, 0] == 3
    assert kp[0, 0, 0, 0] == 4 and kp[0, 1, 0, 0] == 5 and kp[5, 0, 0, 0] == 6
    assert kp.count_nonzero() == 6


def _cache(rows=3, cap=8, hkv=2, d=64):
    return torch.zeros(rows, cap, hkv, d), torch.zeros(rows, cap, hkv, d)


@pytest.mark.parametrize("case,needle", [
    ("max_seqlen_q below q's length", r"max_seqlen_q=1 with a dense q must be an int >= q.shape\[1\] \(2\)"),
    ("max_seqlen_q a bool", r"max_seqlen_q=True with a dense q"),
    ("fewer cache rows than batch", r"k_cache has 1 rows for a batch of 2; give cache_batch_idx"),
    ("k_cache and v_cache lengths differ", r"must have the same \(batch, seqlen\) dims"),
    ("cache_batch_idx int64", r"cache_batch_idx must have dtype torch.int32"),
    ("cache_batch_idx too short", r"cache_batch_idx must have shape \(2,\)"),
    ("append without cache_seqlens", r"cache_seqlens is required when appending k/v"),
    ("new k dtype", r"k has dtype torch.float16 but k_cache has torch.float32"),
    ("new v heads", r"v \(2, 1, 3, 64\) must have the heads and head dim of v_cache"),
    ("new k batch", r"must be \(batch=2, S_new, Hkv, D\)"),
    ("append past the end", r"cache_seqlens=8 with 1 new keys does not fit the cache of 8 keys"),
    ("cu_seqlens_q a list", r"cu_seqlens_q must be a 1-D int32 tensor"),
])
def test_kvcache_argument_refusals_write_nothing(cpu_tensors, case, needle):
    """Each bad argument raises a ValueError naming it, before the cache is written."""
    q = torch.zeros(2, 2, 4, 64)
    kc, vc = _cache()
    new = torch.ones(2, 1, 2, 64)
    kw = dict(k=new, v=new, cache_seqlens=1)
    if case == "max_seqlen_q below q's length":
        kw["max_seqlen_q"] = 1
    elif case == "max_seqlen_q a bool":
        kw["max_seqlen_q"] = True
    elif case == "fewer cache rows than batch":
        kc, vc = _cache(rows=1)
    elif case == "k_cache and v_cache lengths differ":
        vc = torch.zeros(3, 4, 2, 64)
    elif case == "cache_batch_idx int64":
        kw["cache_batch_idx"] = torch.zeros(2, dtype=torch.int64)
    elif case == "cache_batch_idx too short":
        kw["cache_batch_idx"] = torch.zeros(1, dtype=torch.int32)
    elif case == "append without cache_seqlens":
        kw["cache_seqlens"] = None
    elif case == "new k dtype":
        kw["k"] = new.half()
    elif case == "new v heads":
        kw["v"] = torch.ones(2, 1, 3, 64)
    elif case == "new k batch":
        kw["k"] = kw["v"] = torch.ones(3, 1, 2, 64)
    elif case == "append past the end":
        kw["cache_seqlens"] = 8
    elif case == "cu_seqlens_q a list":
        q = torch.zeros(4, 4, 64)
        kw = dict(cu_seqlens_q=[0, 2, 4], max_seqlen_q=2)
    with pytest.raises(ValueError, match=needle):
        fa.flash_attn_with_kvcache(q, kc, vc, **kw)
    assert kc.count_nonzero() == 0 and vc.count_nonzero() == 0


def test_kvcache_contiguous_cache_reads_the_first_batch_rows(forward):
    """Without cache_batch_idx a cache with spare rows is read as its first B rows (views, no copy), the append
    lands at cache_seqlens and the forward sees cache_seqlens + S_new keys; a consistent max_seqlen_q with a dense
    q is accepted and dropped; the default return is out alone."""
    q = torch.zeros(2, 3, 4, 64)
    kc, vc = _cache(rows=5)
    new = torch.ones(2, 3, 2, 64)
    seqlens = torch.tensor([0, 4], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, new, -new, cache_seqlens=seqlens, max_seqlen_q=3)
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.full_like(q, 2.0))
    assert forward["k"].shape[0] == 2 and forward["k"].data_ptr() == kc.data_ptr()
    assert forward["page_table"] is None and forward["max_seqlen_q"] is None
    assert forward["seqused_k"].tolist() == [3, 7]
    assert kc[0, :3].eq(1).all() and kc[1, 4:7].eq(1).all() and vc[1, 4:7].eq(-1).all()
    assert kc.count_nonzero() == 2 * 3 * 2 * 64  # nothing else written (rows 2-4 untouched)


def test_kvcache_cache_batch_idx_becomes_a_one_page_table(forward):
    """cache_batch_idx picks a row per entry: the forward reads the whole cache as pages of S_cache rows through
    the table cache_batch_idx[:, None]."""
    q = torch.zeros(2, 1, 4, 64)
    kc, vc = _cache(rows=4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, torch.ones(2, 1, 2, 64), torch.ones(2, 1, 2, 64),
                                         cache_seqlens=5, cache_batch_idx=idx, return_softmax_lse=True)
    assert lse.tolist() == [3.0] and out.shape == q.shape
    assert forward["k"] is kc and forward["page_table"].tolist() == [[3], [1]]
    assert forward["seqused_k"].tolist() == [6, 6]
    assert kc[3, 5].eq(1).all() and kc[1, 5].eq(1).all() and kc.count_nonzero() == 2 * 2 * 64


@pytest.mark.parametrize("name", ["page_table", "block_table"])
def test_kvcache_paged_cache_passes_its_table(forward, name):
    """A paged cache goes to the forward with its page table (block_table is the same argument); without
    cache_seqlens nothing is appended and every page of the table counts."""
    q = torch.zeros(2, 1, 4, 64)
    kp, vp = _pool()
    table = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    fa.flash_attn_with_kvcache(q, kp, vp, **{name: table})
    assert forward["page_table"] is table and forward["k"] is kp
    assert forward["seqused_k"] is None and forward["cu_seqlens_k"] is None
    assert kp.count_nonzero() == 0


def test_kvcache_signature_is_fa2_fa3_compatible():
    params = inspect.signature(fa.flash_attn_with_kvcache).parameters
    assert list(params)[:5] == ["q", "k_cache", "v_cache", "k", "v"]
    for n in ("cache_seqlens", "cache_batch_idx", "page_table", "block_table", "softmax_scale", "causal",
              "window_size", "softcap", "learnable_sink", "num_splits", "return_softmax_lse", "rotary_cos",
              "rotary_sin", "rotary_interleaved", "cache_leftpad", "alibi_slopes"):
        assert params[n].kind is inspect.Parameter.KEYWORD_ONLY, n
    assert params["num_splits"].default == 0  # FA2/FA3's default: automatic (one split in this release)
