"""The fused backward's S/dP warp grid (config_bwd ``q_warp_rows``), host side (CPU): its name, the splits and
tiles it refuses, the fused-table tag that selects it, and that no default selection takes it."""

import pytest

from flash_attn_4_sm120 import config_bwd
from flash_attn_4_sm120.config import HEAD_DIMS

Q32 = (64, 128, 8, 32, "q32")  # the d64 trial: 2 x 4 warps over S and dP instead of 4 x 2


def _cfg(**kw):
    base = dict(dtype="bf16", head_dim=64, head_dim_v=64, tile_m=64, tile_n=128, num_warps=8, kv_warp_rows=32,
                fused_dq=True)
    return config_bwd.BwdKernelConfig(**dict(base, **kw))


def test_name_suffix_only_off_the_default():
    assert _cfg().name() == "bwd_bf16_d64v64_64x128w8r32f"
    assert _cfg(q_warp_rows=32).name() == "bwd_bf16_d64v64_64x128w8r32q32f"
    assert _cfg(q_warp_rows=32, dq_relay=True, windowed=True).name() == "bwd_bf16_d64v64_64x128w8r32q32fr_win"
    assert _cfg(q_warp_rows=32) != _cfg()  # its own compile key


@pytest.mark.parametrize("tile", [Q32, (64, 128, 8, 32, "q64"), (64, 64, 8, 32, "q32")])
def test_buildable_splits_have_no_problems(tile):
    cfg = config_bwd._fused_tile_config("bf16", 64, 64, tile, {})
    assert cfg.q_warp_rows == int(tile[-1][1:]) and cfg.kv_warp_rows == 32 and cfg.fused_dq
    assert config_bwd.bwd_problems(cfg) == []


@pytest.mark.parametrize("kw, needle", [
    (dict(q_warp_rows=48), "q_warp_rows=48 must be a positive multiple of 16 dividing tile_m=64"),
    (dict(q_warp_rows=8), "q_warp_rows=8 must be a positive multiple of 16"),
    (dict(q_warp_rows=128), "dividing tile_m=64"),
    # 2 x 4 warps need 64 columns per repetition: a 32-key tile cannot take them
    (dict(q_warp_rows=32, tile_n=32, kv_warp_rows=16), "backward warp split 2x4 does not divide 32"),
    # 32 rows per warp on 128 query rows wants 4 warps along them: a 2-warp CTA has 2
    (dict(q_warp_rows=32, tile_m=128, num_warps=2, kv_warp_rows=16), "4 warps along tile_m=128 do not split 2"),
    (dict(q_warp_rows=32, kv_rows=True, kv_warp_rows=16, fused_dq=False), "key-row and V-in-registers"),
])
def test_refused_splits_name_the_value(kw, needle):
    problems = config_bwd.bwd_problems(_cfg(**kw))
    assert any(needle in p for p in problems), problems


def test_the_v_in_registers_tile_refuses_it():
    cfg = config_bwd.BwdVRegsKernelConfig("bf16", 256, 256, 32, 64, 8, kv_warp_rows=32, fused_dq=True,
                                          q_warp_rows=32)
    assert any("key-row and V-in-registers" in p for p in config_bwd.bwd_problems(cfg))
    assert not config_bwd.bwd_problems(config_bwd.BwdVRegsKernelConfig("bf16", 256, 256, 32, 64, 8,
                                                                        kv_warp_rows=32, fused_dq=True))


def test_unknown_tag_raises():
    with pytest.raises(ValueError, match="'x32'"):
        config_bwd._fused_tile_config("bf16", 64, 64, (64, 128, 8, 32, "x32"), {})


def test_spill_entries_of_the_grid_have_their_own_key(monkeypatch):
    """A ``_BWD_SPILLING`` entry for the q32 tile (the key gains the rows per warp) holds for it alone, and the
    16-row tile's entries do not reach it."""
    spilling = dict(config_bwd._BWD_SPILLING)
    spilling[((64, 128, 8, 32, False, 32), 64)] = {"dropout"}
    spilling[((64, 128, 8, 32, False), 64)] = {"aux_mods"}
    monkeypatch.setattr(config_bwd, "_BWD_SPILLING", spilling)
    q32 = config_bwd._fused_tile_config("bf16", 64, 64, Q32, {"has_dropout": True})
    base = config_bwd._fused_tile_config("bf16", 64, 64, Q32[:4], {"has_dropout": True})
    assert any("spills registers with dropout" in p for p in config_bwd.bwd_problems(q32))
    assert config_bwd.bwd_problems(base) == []
    from flash_attn_4_sm120 import modspec

    mods = modspec.recipe_placeholder("relative_bias", (), ("table",), False)
    assert config_bwd.bwd_problems(config_bwd._fused_tile_config("bf16", 64, 64, Q32, {"mods": mods})) == []
    assert config_bwd.bwd_problems(config_bwd._fused_tile_config("bf16", 64, 64, Q32[:4], {"mods": mods}))


def test_aux_reading_mods_are_refused_on_it():
    """The compile gate found the q32 tile spilling with aux-reading mods only (benchmarks/results/
    gate_qgrid_s37.jsonl): those calls take the next tile; a mask mod without aux tensors keeps it."""
    from flash_attn_4_sm120 import modspec

    aux = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), True)
    causal = modspec.recipe_placeholder("causal", (), (), False)
    for flags in ({"mods": aux}, {"mods": aux, "windowed": True}, {"mods": aux, "dq_relay": True}):
        problems = config_bwd.bwd_problems(config_bwd._fused_tile_config("bf16", 64, 64, Q32, flags))
        assert problems == ["backward tile spills registers with aux_mods on sm_120a"], (flags, problems)
    assert config_bwd.bwd_problems(config_bwd._fused_tile_config("bf16", 64, 64, Q32, {"mods": causal})) == []


def test_a_table_entry_selects_it(monkeypatch):
    """What benchmarks/experiments/bwd_fused_ab.py --fused-tile 64:64,128,8,32,q32 does to the table."""
    monkeypatch.setitem(config_bwd._FUSED_TILES, 64, ((Q32, "all"),))
    for flags in ({}, {"windowed": True}, {"has_dropout": True}, {"has_softcap": True, "varlen_q": True}):
        cfg = config_bwd.select_fused_config("bf16", 64, 64, **flags)
        assert (cfg.tile_m, cfg.tile_n, cfg.kv_warp_rows, cfg.q_warp_rows) == (64, 128, 32, 32), flags
    relay, _ = config_bwd.fused_for(config_bwd.select_bwd_config("bf16", 64, 64), relay=True)
    assert relay.dq_relay and relay.q_warp_rows == 32
    from flash_attn_4_sm120 import modspec

    aux = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), True)
    assert config_bwd.select_fused_config("bf16", 64, 64, mods=aux) is None  # its only entry spills: the pair


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("flags", [{}, {"has_dropout": True}, {"has_softcap": True, "varlen_q": True,
                                                               "varlen_k": True}])
def test_no_default_selection_takes_it(windowed, flags):
    for d in HEAD_DIMS:
        for select in (config_bwd.select_fused_config, config_bwd.select_bwd_config, config_bwd.select_dq_config):
            try:
                cfg = select("bf16", d, d, windowed=windowed, **flags)
            except ValueError:
                continue
            assert cfg is None or cfg.q_warp_rows == 16, (select.__name__, d)


def test_repr_names_it_only_off_the_default():
    """The disk compile cache and the prebuilt manifest key on the repr: the default keys must not move, and the
    q32 variant must not share one with the 16-row tile."""
    assert "q_warp_rows" not in repr(_cfg())
    assert "kv_warp_rows=32, q_warp_rows=32, mods=None" in repr(_cfg(q_warp_rows=32))
    assert repr(_cfg(q_warp_rows=32)) != repr(_cfg())
    assert "q_warp_rows" not in repr(config_bwd.select_dq_config("bf16", 64, 64))
