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
    (96, True, {}, (64, 64)), (192, False, {}, None), (256, True, {}, (32, 64)), (32, False, {}, None),
])
def test_fused_tile_policy(d, windowed, flags, expect):
    cfg = config_bwd.select_fused_config("bf16", d, d, windowed=windowed, **flags)
    if expect is None:
        assert cfg is None
    else:
        assert cfg.fused_dq and (cfg.tile_m, cfg.tile_n) == expect and not cfg.kv_rows
        assert not config_bwd.bwd_problems(cfg)
        assert config_bwd.bwd_smem_bytes(cfg) <= config_bwd.SMEM_LIMIT_BYTES


@pytest.mark.parametrize("dv, flags, rows", [
    (128, {}, 64), (64, {}, 64), (128, {"windowed": True}, 64),  # the 2 x 4 dK/dV grid
    (128, {"has_dropout": True, "has_softcap": True}, None),  # spills the grid and the 16-row tile: the pair
    (128, {"mods": "aux"}, 16),  # an aux-reading mod spills the grid on sm_120a: the 16-row grid
])
def test_fused_kv_grid_at_d128(dv, flags, rows):
    """d128's fused tile puts its dK/dV warps 2 x 4 (64 key rows each) unless the feature set spills that grid
    (config_bwd._BWD_SPILLING), where the 16-row grid of the same tile runs; d64's is 4 x 2 (32 rows)."""
    if flags.get("mods") == "aux":
        from flash_attn_4_sm120 import modspec

        flags = {"mods": modspec.recipe_placeholder("relative_bias", (), ("table",), False)}
    cfg = config_bwd.select_fused_config("bf16", 128, dv, **flags)
    if rows is None:
        assert cfg is None
        return
    assert (cfg.tile_m, cfg.tile_n, cfg.kv_warp_rows) == (32, 128, rows) and not config_bwd.bwd_problems(cfg)
    d64 = config_bwd.select_fused_config("bf16", 64, 64, **flags)  # 4 x 2; an aux-reading mod spills it: 64x64
    assert (d64.tile_n, d64.kv_warp_rows) == ((64, 16) if "mods" in flags else (128, 32))


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


# ---- the V-in-registers tile at d256 (kernels/bwd_dkdv_vregs.py): built and gated, selected only as a trial ----
def test_vregs_tile_fits_where_the_p_ds_tile_of_its_shape_does_not():
    cfg = config_bwd.select_fused_config("bf16", 256, 256, trial=True)
    assert isinstance(cfg, config_bwd.BwdVRegsKernelConfig) and cfg.fused_dq
    assert (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.kv_warp_rows) == (32, 64, 8, 32)
    assert config_bwd.bwd_smem_bytes(cfg) == 99328 <= config_bwd.SMEM_LIMIT_BYTES
    assert not config_bwd.bwd_problems(cfg)
    # the same tile with V in shared memory beside P and dS: over SM120's limit
    pds = config_bwd.BwdKernelConfig("bf16", 256, 256, 32, 64, 8, kv_warp_rows=32, fused_dq=True)
    assert config_bwd.bwd_smem_bytes(pds) == 106496
    assert any("shared memory" in p for p in config_bwd.bwd_problems(pds))


def test_vregs_tile_is_the_d256_default(monkeypatch):
    monkeypatch.delenv(config_bwd.FUSED_TRIAL_ENV, raising=False)
    assert isinstance(config_bwd.select_fused_config("bf16", 256, 256), config_bwd.BwdVRegsKernelConfig)
    pair = config_bwd.select_bwd_config("bf16", 256, 256, windowed=True)
    fused, cvt = config_bwd.fused_for(pair)
    assert isinstance(fused, config_bwd.BwdVRegsKernelConfig) and fused.windowed
    assert (cvt.tile_m, cvt.num_warps, cvt.head_dim) == (32, 8, 256)


def test_the_environment_switches_a_trial_tile_on(monkeypatch):
    """The trial table is empty since the d256 tile moved to the defaults; the switch still works for a new entry."""
    monkeypatch.setattr(config_bwd, "_FUSED_TRIAL_TILES", {128: (((64, 64, 8), "all"),)})
    monkeypatch.delenv(config_bwd.FUSED_TRIAL_ENV, raising=False)
    assert config_bwd.select_fused_config("bf16", 128, 128).tile_m == 32  # the default 32x128
    monkeypatch.setenv(config_bwd.FUSED_TRIAL_ENV, "96, 128")
    assert (config_bwd.select_fused_config("bf16", 128, 128).tile_m,) == (64,)
    assert config_bwd.select_fused_config("bf16", 64, 64).tile_n == 128  # other head dims keep their tiles
    monkeypatch.setenv(config_bwd.FUSED_TRIAL_ENV, "1280")
    assert config_bwd.select_fused_config("bf16", 128, 128).tile_m == 32


@pytest.mark.parametrize("kw,needle", [
    (dict(fused_dq=False), "fused tile"), (dict(sparse_q_ratio=1, sparse_kv_ratio=1), "block-sparse"),
    (dict(tile_m=24), "multiple of 16"), (dict(tile_n=96), "multiple of 8 x warps"), (dict(num_warps=4), "8 warps"),
    (dict(kv_warp_rows=64), "16 or 32 key rows"), (dict(tile_m=64), "shared memory"),
    (dict(head_dim_v=96), "multiples of 64"),
])
def test_vregs_problems_name_the_value(kw, needle):
    base = dict(dtype="bf16", head_dim=256, head_dim_v=256, tile_m=32, tile_n=64, num_warps=8, kv_warp_rows=32,
                fused_dq=True)
    problems = config_bwd.bwd_problems(config_bwd.BwdVRegsKernelConfig(**dict(base, **kw)))
    assert any(needle in p for p in problems), problems


def test_vregs_serves_the_pairs_whose_dims_divide():
    for dv, served in ((256, True), (192, True), (128, True), (64, True), (96, False), (32, False)):
        cfg = config_bwd.select_fused_config("bf16", 256, dv, trial=True)
        assert (cfg is not None) == served, dv
    assert [config_bwd.vregs_chunk_cols(x) for x in (64, 128, 192, 256)] == [64, 128, 64, 128]


def test_vregs_key_and_route_are_its_own():
    from flash_attn_4_sm120 import jit

    cfg = config_bwd.select_fused_config("fp16", 256, 256, trial=True, has_dropout=True)
    assert cfg.name().startswith("bwdvr_fp16_d256v256_32x64w8r32f") and cfg.name().endswith("_drop")
    assert jit.kernel_route(cfg) == ("bwd_dkdv_vregs", "FlashBwdDkdvVRegs")
    plain = config_bwd.BwdKernelConfig("fp16", 256, 256, 32, 64, 8, kv_warp_rows=32, fused_dq=True,
                                       has_dropout=True)
    assert cfg != plain and repr(cfg) != repr(plain)
    assert jit.kernel_route(plain) == ("bwd_dkdv", "FlashBwdDkdv")


def test_vregs_configs_are_in_the_gate():
    names = {c.name() for c in GL.fused_trial_worklist()}
    for dtype in ("bf16", "fp16"):
        for windowed in (False, True):
            heavy = dict(windowed=windowed, has_softcap=True, varlen_q=True, varlen_k=True, seqused_q=True,
                         seqused_k=True)
            for flags in (dict(windowed=windowed), heavy):
                cfg = config_bwd.select_fused_config(dtype, 256, 256, trial=True, **flags)
                assert cfg.name() in names
                assert config_bwd.dq_convert_config(cfg).name() in names
    for windowed in (False, True):
        for flags in (dict(has_dropout=True), dict(has_dropout=True, dropout_seed_tensor=True, has_softcap=True,
                                                   varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)):
            cfg = config_bwd.select_fused_config("bf16", 256, 256, trial=True, windowed=windowed, **flags)
            assert cfg.name() in names
            assert config_bwd.replace(cfg, dq_relay=True).name() not in names  # no relay form (vregs_problems)
    assert all(isinstance(c, (config_bwd.BwdVRegsKernelConfig, config_bwd.DqConvertKernelConfig))
               for c in GL.fused_trial_worklist())
    assert names <= {c.name() for c in GL.hand_worklist()}


def test_vregs_takes_mods_and_the_gate_builds_them():
    from flash_attn_4_sm120 import modspec

    doc = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
    cfg = config_bwd.select_fused_config("bf16", 256, 256, trial=True, mods=doc, windowed=True, varlen_q=True,
                                         varlen_k=True, seqused_q=True, seqused_k=True)
    assert isinstance(cfg, config_bwd.BwdVRegsKernelConfig)
    assert cfg.name() in {c.name() for c in GL.fused_trial_worklist()}


def test_vregs_has_no_relay_form(monkeypatch):
    monkeypatch.setenv(config_bwd.FUSED_TRIAL_ENV, "256")
    monkeypatch.setattr(config_bwd, "RELAY_HEAD_DIMS", frozenset({64, 256}))
    pair = config_bwd.select_bwd_config("bf16", 256, 256)
    assert config_bwd.fused_for(pair, relay=True) is None  # deterministic=True: the kernel pair
    assert isinstance(config_bwd.fused_for(pair)[0], config_bwd.BwdVRegsKernelConfig)


def test_vregs_tile_builds_other_shapes():
    """The V-in-registers tile's rule takes the shapes session 38 measured at d64 (64x128) and d128 (64x64, 32x128);
    no table selects them (they lost to the defaults), and they keep no relay form."""
    for d, tm, tn in ((64, 64, 128), (128, 64, 64), (128, 32, 128)):
        cfg = config_bwd._fused_tile_config("bf16", d, d, (tm, tn, 8, 32, "vregs"), {})
        assert isinstance(cfg, config_bwd.BwdVRegsKernelConfig) and not config_bwd.bwd_problems(cfg), cfg
        assert any("relay" in p for p in config_bwd.bwd_problems(config_bwd.replace(cfg, dq_relay=True)))
        assert type(config_bwd.select_fused_config("bf16", d, d, trial=True)) is config_bwd.BwdKernelConfig
