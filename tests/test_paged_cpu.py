"""Paged K/V and flash_attn_with_kvcache on the host: every bad input raises a clear error before any launch
(no GPU needed: the checks run before anything touches CUDA), the paged configuration's compile key, tile
choice and argument record."""

import inspect

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import arguments, config, validate as V

CPU = torch.device("cpu")


def _pool(num_pages=6, page_size=16, hkv=2, d=64, dv=64):
    return torch.zeros(num_pages, page_size, hkv, d), torch.zeros(num_pages, page_size, hkv, dv)


def _table(batch=2, pages=3, dtype=torch.int32):
    return torch.zeros(batch, pages, dtype=dtype)


def test_page_table_checks_accept_a_valid_table():
    k, v = _pool()
    assert V.check_page_table(_table(), k, v, 2, CPU, None) == (6, 16, 3)


def test_fused_cache_views_pass_the_checks():
    cache = torch.zeros(2, 6, 16, 2, 64)
    k, v = cache[0], cache[1]  # vLLM's (2, num_blocks, block_size, Hkv, D), unbound
    assert V.check_page_table(_table(), k, v, 2, CPU, None) == (6, 16, 3)


@pytest.mark.parametrize("make,needle", [
    (lambda k, v: dict(page_table=_table(dtype=torch.int64)), "int32"),
    (lambda k, v: dict(page_table=_table().view(-1)), "2-D"),
    (lambda k, v: dict(page_table=torch.zeros(2, 3, 1, dtype=torch.int32)), "2-D"),
    (lambda k, v: dict(page_table=[[0, 1]]), "torch.Tensor"),
    (lambda k, v: dict(page_table=_table(batch=3)), "batch is 2"),
    (lambda k, v: dict(page_table=_table().t().contiguous().t()), "contiguous"),
    (lambda k, v: dict(k=torch.zeros(6, 16, 2, 64), v=torch.zeros(6, 8, 2, 64)), "same pages"),
    (lambda k, v: dict(k=torch.zeros(6, 16, 2, 64), v=torch.zeros(5, 16, 2, 64)), "same pages"),
    (lambda k, v: dict(k=torch.zeros(6, 0, 2, 64), v=torch.zeros(6, 0, 2, 64)), "page_size"),
    (lambda k, v: dict(k=torch.zeros(0, 16, 2, 64), v=torch.zeros(0, 16, 2, 64)), "no pages"),
    (lambda k, v: dict(k=torch.zeros(1, 1, 1, 1).expand(6, 1 << 14, 2, 64),
                       v=torch.zeros(1, 1, 1, 1).expand(6, 1 << 14, 2, 64),
                       page_table=torch.zeros(2, 1 << 15, dtype=torch.int32)), "exceeds"),
    (lambda k, v: dict(cu_seqlens_k=torch.zeros(3, dtype=torch.int32)), "cu_seqlens_k"),
])
def test_page_table_checks_name_the_problem(make, needle):
    k, v = _pool()
    args = dict(page_table=_table(), k=k, v=v, cu_seqlens_k=None)
    args.update(make(k, v))
    with pytest.raises(ValueError) as info:
        V.check_page_table(args["page_table"], args["k"], args["v"], 2, CPU, args["cu_seqlens_k"])
    assert needle in str(info.value), str(info.value)


def test_page_table_with_cu_seqlens_k_raises_first():
    """Raised before the rank/device checks, so the message names the real conflict."""
    q = torch.zeros(16, 4, 64)
    k, v = _pool()
    with pytest.raises(ValueError, match="page_table cannot be combined with cu_seqlens_k"):
        fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.tensor([0, 8, 16], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 8, 16], dtype=torch.int32), page_table=_table())


@pytest.mark.parametrize("bad", [1.0, "2", None, 2.5])
def test_num_splits_not_an_int(bad):
    q = torch.zeros(2, 1, 4, 64)
    k, v = _pool()
    with pytest.raises(ValueError, match="num_splits must be an int"):
        fa.flash_attn_varlen_func(q, k, v, page_table=_table(), num_splits=bad)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        fa.flash_attn_with_kvcache(q, k, v, page_table=_table(), num_splits=bad)


@pytest.mark.parametrize("which", ["q", "k", "v", "sink"])
def test_requires_grad_paged_call_raises_before_launch(which):
    q = torch.zeros(2, 1, 4, 64, requires_grad=which == "q")
    k, v = _pool()
    k.requires_grad_(which == "k")
    v.requires_grad_(which == "v")
    sink = torch.zeros(4, requires_grad=which == "sink")
    with pytest.raises(ValueError, match="inference-only"):
        fa.flash_attn_varlen_func(q, k, v, page_table=_table(), learnable_sink=sink)
    with pytest.raises(ValueError, match="inference-only"):
        fa.flash_attn_func(q, k, v, page_table=_table(), learnable_sink=sink)
    with pytest.raises(ValueError, match="inference-only"):
        fa.flash_attn_with_kvcache(q, k, v, page_table=_table(), learnable_sink=sink)


def test_run_forward_refuses_grad_with_pages():
    from flash_attn_4_sm120 import dispatch

    assert "inference-only" in dispatch.PAGED_GRAD_ERROR
    src = inspect.getsource(dispatch.run_forward)
    assert "page_table is not None and needs_grad" in src


@pytest.mark.parametrize("kw,exc,needle", [
    (dict(rotary_cos=torch.zeros(1)), NotImplementedError, "rotary"),
    (dict(rotary_sin=torch.zeros(1)), NotImplementedError, "rotary"),
    (dict(alibi_slopes=torch.zeros(4)), NotImplementedError, "alibi_slopes"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError, "cache_leftpad"),
    (dict(attention_chunk=128), NotImplementedError, "attention_chunk"),
    (dict(sm_margin=4), NotImplementedError, "sm_margin"),
    (dict(page_table=_table(), block_table=_table()), ValueError, "not both"),
    (dict(page_table=_table(), cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError, "cache_batch_idx"),
])
def test_kvcache_rejects(kw, exc, needle):
    q = torch.zeros(2, 1, 4, 64)
    k, v = _pool()
    with pytest.raises(exc) as info:
        fa.flash_attn_with_kvcache(q, k, v, **kw)
    assert needle in str(info.value), str(info.value)


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


def test_paged_config_runs_the_cpasync_kernel():
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            tile = config.select_fwd_tile(d, dv, windowed, paged=True)
            assert not tile.tma
            assert not config.fwd_tile_problems(d, dv, tile)
    cfg = config.FwdKernelConfig("bf16", 128, 128, config.select_fwd_tile(128, 128, False, True), paged=True)
    assert cfg.name().endswith("_paged")
    assert cfg != config.FwdKernelConfig("bf16", 128, 128, cfg.tile)  # part of the compile key


def test_paged_tma_config_is_refused():
    from flash_attn_4_sm120 import jit

    tma = config.select_fwd_tile(128, 128, False)
    assert tma.tma
    with pytest.raises(ValueError, match="cp.async"):
        jit.kernel_class(config.FwdKernelConfig("bf16", 128, 128, tma, paged=True))


def test_page_table_argument_in_the_forward_record():
    arg = {a.name: a for a in arguments.FWD_ARGS.args}["page_table"]
    assert arg.kind == "i32mat" and arg.when == "paged"


def test_paged_gate_worklist_covers_each_paged_tile():
    work = config.paged_gate_worklist()
    tiles = {c.tile for c in work}
    for d, dv in config.supported_head_dim_pairs():
        if d == dv:
            for w in (False, True):
                assert config.select_fwd_tile(d, dv, w, True) in tiles
    assert all(c.paged and not c.varlen_k for c in work)
    assert any(c.windowed and c.has_sink and c.varlen_q for c in work)


def test_kvcache_signature_is_fa2_fa3_compatible():
    params = inspect.signature(fa.flash_attn_with_kvcache).parameters
    assert list(params)[:5] == ["q", "k_cache", "v_cache", "k", "v"]
    for n in ("cache_seqlens", "cache_batch_idx", "page_table", "block_table", "softmax_scale", "causal",
              "window_size", "softcap", "learnable_sink", "num_splits", "return_softmax_lse", "rotary_cos",
              "rotary_sin", "rotary_interleaved", "cache_leftpad", "alibi_slopes"):
        assert params[n].kind is inspect.Parameter.KEYWORD_ONLY, n
    assert params["num_splits"].default == 0  # FA2/FA3's default: automatic (one split in this release)
