"""Paged K/V on the host: every bad input raises a clear error before any launch (no GPU needed: the checks run
before anything touches CUDA), the paged configuration's compile key, tile choice and argument record.
flash_attn_with_kvcache's own arguments (append, cache layouts, refusals): tests/test_kvcache.py."""

import inspect

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import arguments, config, config_decode, plan as P, validate as V
from scripts import gate_lists as GL

CPU = torch.device("cpu")


def _pool(num_pages=6, page_size=16, hkv=2, d=64, dv=64):
    return torch.zeros(num_pages, page_size, hkv, d), torch.zeros(num_pages, page_size, hkv, dv)


def _table(batch=2, pages=3, dtype=torch.int32):
    return torch.zeros(batch, pages, dtype=dtype)


def test_page_table_checks_accept_a_valid_table():
    k, v = _pool()
    assert V.check_page_table(_table(), k, v, 2, CPU) == (6, 16, 3)


def test_fused_cache_views_pass_the_checks():
    cache = torch.zeros(2, 6, 16, 2, 64)
    k, v = cache[0], cache[1]  # vLLM's (2, num_blocks, block_size, Hkv, D), unbound
    assert V.check_page_table(_table(), k, v, 2, CPU) == (6, 16, 3)


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
])
def test_page_table_checks_name_the_problem(make, needle):
    k, v = _pool()
    args = dict(page_table=_table(), k=k, v=v)
    args.update(make(k, v))
    with pytest.raises(ValueError) as info:
        V.check_page_table(args["page_table"], args["k"], args["v"], 2, CPU)
    assert needle in str(info.value), str(info.value)


def test_page_table_with_cu_seqlens_k_raises_first():
    """Raised before the rank/device checks, so the message names the real conflict."""
    q = torch.zeros(16, 4, 64)
    k, v = _pool()
    with pytest.raises(ValueError, match="page_table cannot be combined with cu_seqlens_k"):
        fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.tensor([0, 8, 16], dtype=torch.int32),
                                  cu_seqlens_k=torch.tensor([0, 8, 16], dtype=torch.int32), page_table=_table())


@pytest.mark.parametrize("bad", [1.0, "2", 2.0, 2.5])  # None is the default (automatic for inference calls)
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


def test_paged_grad_is_refused_by_the_compat_table_only():
    """The one refusal of paged K/V with grad: compat.py's row, checked by interface before any routing (autograd,
    the torch.library op); the launch sequence holds no refusal."""
    from flash_attn_4_sm120 import compat, dispatch

    assert "inference-only" in compat.CONFLICTS["paged_grad"].message
    with pytest.raises(ValueError, match="inference-only"):
        compat.check_call(p=0.0, dropout_p=0.0, num_splits=1, sparse=False, sparse_bwd=False, paged=True,
                          cu_seqlens_k=False, pack_gqa=None, needs_grad=True, compiling=False, mods=False,
                          score_mod=False, softcap=0.0, q=None, v=None)
    assert "raise " not in inspect.getsource(dispatch.run_forward).split('"""')[2]  # the body, past the docstring


def test_paged_config_runs_the_cpasync_kernel():
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            tile = config.select_fwd_tile(d, dv, windowed, paged=True)
            assert not tile.tma
            assert not config.fwd_tile_problems(d, dv, tile)
    cfg = config.FwdKernelConfig("bf16", 128, 128, config.select_fwd_tile(128, 128, False, True), paged=True)
    assert cfg.name().endswith("_paged")
    assert cfg != config.FwdKernelConfig("bf16", 128, 128, cfg.tile)  # part of the compile key


def test_paged_tma_config_runs_the_tma_kernel():
    from flash_attn_4_sm120 import jit
    from flash_attn_4_sm120.kernels.fwd_cpasync import FlashFwdCpAsync
    from flash_attn_4_sm120.kernels.fwd_tma import FlashFwdTma

    tma = config.select_fwd_tile(128, 128, False)
    assert tma.tma
    assert jit.kernel_class(config.FwdKernelConfig("bf16", 128, 128, tma, paged=True)) is FlashFwdTma
    cp = config.select_fwd_tile(128, 128, False, paged=True)
    assert jit.kernel_class(config.FwdKernelConfig("bf16", 128, 128, cp, paged=True)) is FlashFwdCpAsync


def _bf16_pool(num_pages=8, page_size=64, hkv=2, d=128):
    return (torch.zeros(num_pages, page_size, hkv, d, dtype=torch.bfloat16),
            torch.zeros(num_pages, page_size, hkv, d, dtype=torch.bfloat16))


def _paged_plan(k, v, d, windowed, **kw):
    """The forward plan run_forward builds for a paged call (the same arguments, device 0, no grad)."""
    tma = P.paged_eligible_for_tma(k, v, d, d, windowed)
    return P.get_plan(P.PlanKey("bf16", d, d, windowed, False, False, False, False, False, True, False, 0, paged=True,
                          paged_tma=tma, **kw))


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("page_size,tma", [(64, True), (128, True), (256, True), (192, True), (16, False),
                                           (1, False), (3, False), (32, False), (96, False), (65, False)])
def test_paged_dispatch_picks_tma_when_pages_hold_whole_tiles(page_size, tma, windowed):
    """d128: the TMA tile (tile_n 64) when page_size % 64 == 0, else the cp.async tile (any page size)."""
    k, v = _bf16_pool(page_size=page_size)
    plan = _paged_plan(k, v, 128, windowed)
    cfg = plan.fwd_cfg
    assert cfg.paged and cfg.tile.tma == tma, cfg.name()
    assert cfg.tile == (config.select_fwd_tile(128, 128, windowed) if tma
                        else config.select_fwd_tile(128, 128, windowed, paged=True))
    assert (config.paged_tma_tile(128, 128, windowed, page_size) is not None) == tma


@pytest.mark.parametrize("page_size", [64, 128])
def test_paged_split_and_decode_keep_their_cpasync_tiles(page_size):
    k, v = _bf16_pool(page_size=page_size)
    assert _paged_plan(k, v, 128, False).fwd_cfg.tile.tma
    split = _paged_plan(k, v, 128, False, split=True).fwd_cfg
    decode = _paged_plan(k, v, 128, False, decode=True).fwd_cfg
    assert split.paged and split.split_kv and not split.tile.tma
    assert split.tile == config.split_tile(config.select_fwd_tile(128, 128, False, paged=True))
    assert decode.paged and not decode.tile.tma and decode.tile == config_decode.decode_tile(128, 128)


def test_paged_tma_tile_per_head_dim():
    # d64: 256x64 TMA tile (page 64 qualifies), windowed 128x128 (page 64 does not, 128 does); d192 128x64 one
    # stage; d256 has no TMA tile
    assert config.paged_tma_tile(64, 64, False, 64).tile_n == 64
    assert config.paged_tma_tile(64, 64, True, 64) is None
    assert config.paged_tma_tile(64, 64, True, 128).tile_n == 128
    assert config.paged_tma_tile(192, 192, False, 64).tma
    assert config.paged_tma_tile(256, 256, False, 64) is None
    assert config.paged_tma_tile(256, 256, False) is None
    assert config.paged_tma_tile(128, 128, False, 0) is None
    for d, dv in config.supported_head_dim_pairs():
        for w in (False, True):
            t = config.paged_tma_tile(d, dv, w)
            assert t is None or (t.tma and t == config.select_fwd_tile(d, dv, w))


def test_paged_mods_keep_the_cpasync_kernel():
    k, v = _bf16_pool()
    assert P.paged_eligible_for_tma(k, v, 128, 128, False)
    assert not P.paged_eligible_for_tma(k, v, 128, 128, False, mods=object())


def test_fused_cache_views_qualify_for_tma_and_misaligned_views_do_not():
    NP, ps, h, d = 6, 64, 2, 128
    for cache, split in ((torch.zeros(2, NP, ps, h, d, dtype=torch.bfloat16), lambda c: (c[0], c[1])),
                         (torch.zeros(NP, 2, ps, h, d, dtype=torch.bfloat16), lambda c: (c[:, 0], c[:, 1]))):
        k, v = split(cache)
        assert P.tma_views_ok(k, v)
        assert _paged_plan(k, v, 128, True).fwd_cfg.tile.tma
    # a fused cache whose base is 8 bytes off a 16-byte boundary
    n = 2 * NP * ps * h * d
    buf = torch.zeros(n + 4, dtype=torch.bfloat16)
    cache = buf[4:].view(2, NP, ps, h, d)
    assert cache.data_ptr() % 16 == 8
    assert not P.tma_views_ok(cache[0], cache[1])
    assert not _paged_plan(cache[0], cache[1], 128, False).fwd_cfg.tile.tma
    # k|v fused along the last dim with 4 elements of padding: v's base and every row stride are 8 bytes off
    kv = torch.zeros(NP, ps, h, 2 * d + 4, dtype=torch.bfloat16)
    k, v = kv[..., :d], kv[..., d + 4:]
    assert P.tma_views_ok(k) is False and not P.tma_views_ok(k, v)
    assert not _paged_plan(k, v, 128, False).fwd_cfg.tile.tma
    # an expanded pool (stride 0)
    k0 = torch.zeros(1, ps, h, d, dtype=torch.bfloat16).expand(NP, ps, h, d)
    assert not P.tma_views_ok(k0, k0)
    # aligned but the last dim strided
    kt = torch.zeros(NP, ps, h, 2 * d, dtype=torch.bfloat16)[..., ::2]
    assert not P.tma_views_ok(kt)


def test_run_forward_passes_the_paged_tma_decision():
    from flash_attn_4_sm120 import dispatch

    src = inspect.getsource(dispatch.run_forward)
    assert "paged and P.paged_eligible_for_tma(k, v, d, dv, windowed, mods, caps.tma), caps.tma)" in src


def test_page_table_argument_in_the_forward_record():
    arg = {a.name: a for a in arguments.FWD_ARGS.args}["page_table"]
    assert arg.kind == "i32mat" and arg.when == "paged"


def test_paged_gate_worklist_covers_each_paged_tile():
    work = GL.paged_gate_worklist()
    tiles = {c.tile for c in work}
    for d, dv in config.supported_head_dim_pairs():
        if d == dv:
            for w in (False, True):
                assert config.select_fwd_tile(d, dv, w, True) in tiles
    assert all(c.paged and not c.varlen_k for c in work)
    assert any(c.windowed and c.has_sink and c.varlen_q for c in work)
    # the TMA-paged tiles: lightest and heaviest set each, never split
    tma = [c for c in work if c.tile.tma]
    for d, dv in config.supported_head_dim_pairs():
        if d == dv:
            for w in (False, True):
                t = config.paged_tma_tile(d, dv, w)
                if t is not None:
                    assert any(c.tile == t and not c.windowed and c.head_dim == d for c in tma)
                    assert any(c.tile == t and c.windowed and c.has_softcap and c.has_sink and c.varlen_q
                               and c.seqused_k and c.head_dim == d for c in tma)
    assert tma and not any(c.split_kv for c in tma)
