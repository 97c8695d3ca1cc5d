"""The fused backward's host side (CPU): which calls it takes, and the dQ workspace's tile map."""

import random

import pytest

from flash_attn_4_sm120 import config_bwd
from flash_attn_4_sm120.arguments import BWD_DKDV_ARGS, DQ_CONVERT_ARGS
from scripts import gate_lists as GL


@pytest.mark.parametrize("d,windowed,flags,expect", [
    (64, False, {}, (64, 128)), (64, True, {}, (64, 128)), (128, False, {}, (32, 128)),
    # d128 windowed walks: 32x128 without mods or dropout (the calls the launch order serves), 64x64 with them
    (128, True, {}, (32, 128)), (128, True, {"has_softcap": True, "varlen_q": True}, (32, 128)),
    (128, True, {"has_dropout": True}, (64, 64)), (128, False, {"has_dropout": True}, (32, 128)),
    (96, True, {}, (64, 64)), (192, False, {}, None), (256, True, {}, None), (32, False, {}, None),
])
def test_fused_tile_policy(d, windowed, flags, expect):
    cfg = config_bwd.select_fused_config("bf16", d, d, windowed=windowed, **flags)
    if expect is None:
        assert cfg is None
    else:
        assert cfg.fused_dq and (cfg.tile_m, cfg.tile_n) == expect and not cfg.kv_rows
        assert not config_bwd.bwd_problems(cfg)
        assert config_bwd.bwd_smem_bytes(cfg) <= config_bwd.SMEM_LIMIT_BYTES


def test_fused_falls_back_where_the_copy_does_not_tile():
    # d128 / dv32: the 32-row tile is not a multiple of the dv32 copy's 64 rows per pass
    assert config_bwd.select_fused_config("bf16", 128, 32) is None


def test_workspace_argument_only_when_fused():
    (arg,) = [a for a in BWD_DKDV_ARGS.args if a.name == "dq_accum"]
    assert arg.when == "fused_dq"
    assert DQ_CONVERT_ARGS.names[0] == "dq_accum"


def test_convert_config_mirrors_the_fused_tile():
    cfg = config_bwd.select_fused_config("fp16", 128, 128, varlen_q=True, seqused_q=True)
    cvt = config_bwd.dq_convert_config(cfg)
    assert (cvt.dtype, cvt.head_dim, cvt.tile_m, cvt.num_warps, cvt.varlen_q, cvt.seqused_q) == (
        "fp16", 128, cfg.tile_m, cfg.num_warps, True, True)


def _tiles(cu, tile_m):
    """The workspace tiles each sequence's query tiles use (bwd_dkdv.add_dq / bwd_dq_convert)."""
    out = []
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        base = cu[b] // tile_m + b
        out.append(range(base, base + -(-n // tile_m)))
    return out


@pytest.mark.parametrize("tile_m", [32, 64])
def test_varlen_workspace_tiles_are_disjoint_and_fit(tile_m):
    rng = random.Random(0)
    for _ in range(300):
        lens = [rng.choice([0, 1, 17, tile_m - 1, tile_m, tile_m + 1, 113, 1023]) for _ in range(rng.randint(1, 9))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        blocks = config_bwd.dq_accum_blocks(tile_m, len(lens), cu[-1], True)
        used = [t for r in _tiles(cu, tile_m) for t in r]
        assert len(used) == len(set(used)), (lens, used)
        assert all(0 <= t < blocks for t in used), (lens, blocks, used)


def test_dense_workspace_tiles():
    assert config_bwd.dq_accum_blocks(64, 3, 113, False) == 3 * 2
    assert config_bwd.dq_accum_blocks(32, 1, 1, False) == 1


def test_fused_configs_are_in_the_gate():
    names = {c.name() for c in GL.fused_gate_worklist()}
    for d, dv in ((64, 64), (128, 128)):
        for flags in ({}, {"has_dropout": True}):
            assert config_bwd.select_fused_config("bf16", d, dv, **flags).name() in names
    assert any(n.startswith("dqcvt_") for n in names)
