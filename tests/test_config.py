"""Host-only layer: tile table, SM120 budgets, argument normalisation, FEATURES.  Runs on a CPU."""

import inspect
import math

import pytest

from flash_attn_4_sm120 import FEATURES, config, config_bwd, features, interface, plan as P
from flash_attn_4_sm120 import validate as V
from flash_attn_4_sm120.config import FwdTile
from scripts import gate_lists as GL


def test_every_selected_tile_fits_sm120():
    for dtype, d, dv, tile in GL.all_fwd_tile_configs():
        assert config.fwd_smem_bytes(d, dv, tile) <= config.SMEM_LIMIT_BYTES, (d, dv, tile)
        assert config.fwd_tile_problems(d, dv, tile) == []


def test_supported_pairs_cover_the_issue_examples():
    pairs = config.supported_head_dim_pairs()
    for d in config.HEAD_DIMS:
        assert (d, d) in pairs
    assert (192, 128) in pairs and (128, 64) in pairs


def test_tile_problems_name_value_and_limit():
    problems = config.fwd_tile_problems(256, 256, FwdTile(128, 128, 8, 2, True))
    text = "; ".join(problems)
    assert "101376" in text and "shared memory" in text


def test_select_raises_with_reasons(monkeypatch):
    monkeypatch.setitem(config._TILE_PREFERENCE, 256, (FwdTile(256, 256, 8, 2),))
    with pytest.raises(ValueError, match=r"head_dim=256.*no forward tile fits"):
        config.select_fwd_tile(256, 256, False)


def test_windowed_override_for_small_head_dims():
    assert config.select_fwd_tile(64, 64, False).tile_m == 256
    assert config.select_fwd_tile(64, 64, True).tile_m == 128
    assert config.select_fwd_tile(128, 128, True) == config.select_fwd_tile(128, 128, False)


def test_smem_formula_matches_known_value():
    # Q 128x128 + 2 stages of K and V 64x128, bf16 = 32 KiB * 3
    assert config.fwd_smem_bytes(128, 128, FwdTile(128, 64, 8, 2, True)) == 98304


def test_copy_threads_per_row():
    assert config.copy_threads_per_row(128, 16) == 16
    assert config.copy_threads_per_row(96, 16) == 4
    assert config.copy_threads_per_row(192, 16) == 8


def test_config_name_and_hash_are_stable():
    a = config.FwdKernelConfig("bf16", 128, 128, FwdTile(128, 64, 8, 2, True), windowed=True)
    b = config.FwdKernelConfig("bf16", 128, 128, FwdTile(128, 64, 8, 2, True), windowed=True)
    assert a == b and hash(a) == hash(b) and a.name() == "fwd_bf16_d128v128_128x64w8s2q_win"


def test_gate_configs_light_heavy_and_split():
    light, heavy, split = GL.gate_configs("bf16", 64, 64, FwdTile(128, 128, 8, 2, True))
    assert not light.windowed and heavy.windowed and heavy.has_sink and heavy.varlen_q
    assert split.split_kv and split.has_sink and split.windowed and split.varlen_q
    assert not light.split_kv and not heavy.split_kv


def test_dropout_gate_configs_light_and_heavy():
    light, heavy, _split = GL.gate_configs("bf16", 64, 64, FwdTile(128, 128, 8, 2, True))
    drop_light, drop_heavy = GL.dropout_gate_configs("bf16", 64, 64, FwdTile(128, 128, 8, 2, True))
    assert not light.has_dropout and not heavy.has_dropout and not _split.has_dropout
    assert drop_light == config.replace(light, has_dropout=True)
    assert drop_heavy == config.replace(heavy, has_dropout=True, dropout_seed_tensor=True)
    assert not any(c.has_dropout for c in GL.bwd_gate_configs("bf16", 128, 128))
    assert "_drop" in drop_light.name() and "_drop" not in light.name()


def test_dropout_gate_worklist_covers_every_tile_light_and_heavy():
    """Every tile of every kernel that dropout can run gets its lightest and heaviest dropout set in the gate, and
    the list stays small (CI time)."""
    work = GL.dropout_gate_worklist()
    assert all(c.has_dropout for c in work) and len(work) <= 90  # 86: +1 per forward tile for dropout_high_p
    assert len({c.name() for c in work}) == len(work)

    def tile_of(c):
        if isinstance(c, config.FwdKernelConfig):
            return ("fwd", c.tile)
        return (type(c).__name__, c.tile_m, c.tile_n, c.num_warps)

    # (the heaviest set without softcap where a tile refuses softcap with dropout: config_bwd._BWD_SPILLING)
    heavy = {tile_of(c) for c in work if c.windowed and c.dropout_seed_tensor}
    light = {tile_of(c) for c in work if not (c.windowed or c.has_softcap or c.varlen_q or c.dropout_seed_tensor)}
    tiles = set()
    for d, dv in config.supported_head_dim_pairs():
        for w in (False, True):
            tiles.add(("fwd", config.dropout_fwd_tile(d, dv, config.select_fwd_tile(d, dv, w))))
        c = config_bwd.select_bwd_config("bf16", d, dv, has_dropout=True)
        tiles.add(("BwdKernelConfig", c.tile_m, c.tile_n, c.num_warps))
        c = config_bwd.select_dq_config("bf16", d, dv, has_dropout=True)
        tiles.add(("DqKernelConfig", c.tile_m, c.tile_n, c.num_warps))
    assert tiles <= heavy and tiles <= light
    assert "dq_bf16_d256v32_64x32w4_win_softcap_vq_vk_uq_uk_drop_seedt_kw_sinkg" in {c.name() for c in work}


def test_dq_row_sums_only_with_a_learnable_sink():
    """The dQ kernel's P dP row sums (only the sink gradient reads them) are compiled, and their output tensor
    passed, only when the call has a sink; the gate builds both variants of every dQ tile."""
    from flash_attn_4_sm120.arguments import BWD_DQ_ARGS

    with_sink = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, True, False, False, False, False, True, 0))
    without = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, False, False, False, False, False, True, 0))
    assert with_sink.dq_cfg.sink_grad and not without.dq_cfg.sink_grad
    assert with_sink.dq_cfg.name() == without.dq_cfg.name() + "_sinkg"
    (arg,) = [a for a in BWD_DQ_ARGS.args if a.name == "pdpsum"]
    assert arg.when == "sink_grad"
    dq_gate = [c for d, dv in config.supported_head_dim_pairs() for c in GL.bwd_gate_configs("bf16", d, dv)
               if isinstance(c, config_bwd.DqKernelConfig)]
    assert {c.sink_grad for c in dq_gate} == {False, True}


def test_dropout_keeps_the_tile_except_where_it_spills():
    """Dropout takes the tile of the path without it, except for the two measured spilling tiles (config.py),
    where it takes the next tile of the preference list; the gate builds the dropout variants on that tile."""
    moved = {}
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            tile = config.select_fwd_tile(d, dv, windowed)
            dtile = config.dropout_fwd_tile(d, dv, tile)
            assert not config.fwd_tile_problems(d, dv, dtile)
            if dtile != tile:
                moved[(d, dv)] = (tile.name(), dtile.name())
    assert moved == {(192, 128): ("128x64w8s1qt", "128x64w8s1t"), (256, 256): ("64x64w4s1", "64x32w4s1")}
    tile = config.select_fwd_tile(256, 256, False)
    drop_light, drop_heavy = GL.dropout_gate_configs("bf16", 256, 256, tile)
    assert drop_light.tile == drop_heavy.tile == FwdTile(64, 32, 4, 1, False)


@pytest.mark.parametrize(
    "causal,window,expected",
    [
        (False, (None, None), (config.WINDOW_UNBOUNDED, config.WINDOW_UNBOUNDED)),
        (True, (None, None), (config.WINDOW_UNBOUNDED, 0)),
        (True, (10, None), (10, 0)),
        (True, (10, 0), (10, 0)),
        (False, (-1, -1), (config.WINDOW_UNBOUNDED, config.WINDOW_UNBOUNDED)),
        (False, (5, 3), (5, 3)),
        (False, (1 << 40, 3), (config.WINDOW_UNBOUNDED, 3)),
    ],
)
def test_resolve_window(causal, window, expected):
    assert V.resolve_window(causal, window) == expected


@pytest.mark.parametrize("window,left", [((None, 1), config.WINDOW_UNBOUNDED), ((3, 2), 3), ((63, 63), 63),
                                         ((-1, 5), config.WINDOW_UNBOUNDED)])
def test_causal_fixes_the_right_bound(window, left):
    # flash-attn-4 b36 / FA2 semantics: causal=True sets right = 0 whatever window_size[1] says
    assert V.resolve_window(True, window) == (left, 0)


def test_none_zero_window_is_causal():
    assert V.resolve_window(False, (None, 0)) == V.resolve_window(True, (None, None))


@pytest.mark.parametrize("bad", [(1,), "ab", (None, 2.5), (True, None)])
def test_bad_window_raises(bad):
    with pytest.raises(ValueError, match="window_size"):
        V.resolve_window(False, bad)


def test_scalars():
    assert V.check_scalars(None, 0.0, 64) == (1 / 8, 0.0)
    for scale in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="softmax_scale"):
            V.check_scalars(scale, 0.0, 64)
    with pytest.raises(ValueError, match="softcap"):
        V.check_scalars(None, -1.0, 64)


def test_head_dim_errors_name_value_and_list():
    with pytest.raises(ValueError, match=r"head_dim=80 .*\(32, 64, 96, 128, 192, 256\)"):
        V.check_head_dims(80, 80)
    with pytest.raises(ValueError, match="head_dim_v=128"):
        V.check_head_dims(64, 128)


def test_heads_error():
    with pytest.raises(ValueError, match=r"query heads \(6\).*KV heads \(4\)"):
        V.check_heads(6, 4, 4)


def test_lengths_and_batch_limits():
    with pytest.raises(ValueError, match=str(config.MAX_SEQLEN)):
        V.check_lengths(seqlen_q=config.MAX_SEQLEN + 1)
    with pytest.raises(ValueError, match="65535"):
        V.check_batch(70000)


def test_features_table_drives_errors(monkeypatch):
    assert FEATURES["forward"].supported
    # a planned feature raises, naming itself (patched in, so the test holds whatever is planned today)
    monkeypatch.setitem(FEATURES, "_probe", features.Feature("_probe", features.PLANNED, "probe=1"))
    with pytest.raises(NotImplementedError, match="_probe"):
        features.require("_probe", "probe=1")
    features.require("forward")  # supported: no error


def test_support_matrix_lists_every_feature():
    md = features.support_matrix_markdown()
    for name in FEATURES:
        assert f"| {name} |" in md


def test_api_is_keyword_compatible_with_upstream():
    upstream_fwd = ["softmax_scale", "causal", "window_size", "learnable_sink", "softcap", "num_splits",
                    "pack_gqa", "deterministic", "block_sparse_tensors", "return_lse"]
    upstream_varlen = upstream_fwd + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                      "seqused_q", "seqused_k", "page_table"]
    for fn, names in ((interface.flash_attn_func, upstream_fwd), (interface.flash_attn_varlen_func, upstream_varlen)):
        params = inspect.signature(fn).parameters
        assert list(params)[:3] == ["q", "k", "v"]
        for n in names:
            assert params[n].kind is inspect.Parameter.KEYWORD_ONLY, n


def test_choose_pack():
    assert P.choose_pack(None, 1, 10, 128) == 1
    assert P.choose_pack(None, 8, 1, 128) == 8
    assert P.choose_pack(False, 8, 1, 128) == 1
    assert P.choose_pack(True, 8, 4096, 128) == 8
    with pytest.raises(ValueError, match="pack_gqa"):
        P.choose_pack("yes", 8, 1, 128)


def test_import_has_no_cutlass_side_effect():
    import subprocess
    import sys

    code = ("import sys; import flash_attn_4_sm120 as m; "
            "print('cutlass' in sys.modules, hasattr(m, 'flash_attn_func'), m.__version__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__('os').environ, "PYTHONPATH": "torch-ext"})
    assert res.stdout.split() == ["False", "True", "1.0.0"]


def test_scalars_that_overflow_fp32_raise():
    with pytest.raises(ValueError, match="overflows fp32"):
        V.check_scalars(None, 1e-41, 128)  # scale / softcap = 9e39
    with pytest.raises(ValueError, match="overflows fp32"):
        V.check_scalars(1e39, 0.0, 128)
    assert V.check_scalars(None, 1e-30, 128)[1] == 1e-30  # small but representable


def test_heads_beyond_the_grid_limit_raise():
    with pytest.raises(ValueError, match="65535"):
        V.check_heads(65536 * 2, 2, 2)
    V.check_heads(65535, 5, 5)


def test_non_tensor_inputs_get_a_clear_error():
    import torch

    from flash_attn_4_sm120 import interface

    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        interface.flash_attn_func([1.0], [1.0], [1.0])
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # CPU tensors: refused before any launch
        interface.flash_attn_func(q, q, q, learnable_sink=[0.0, 0.0])


# ---- decode tiles (config_decode) ----------------------------------------------------------------------------------
def test_decode_tiles_by_rows_and_the_key_split_switch(monkeypatch):
    from flash_attn_4_sm120 import config_decode as CD

    assert CD.DECODE_KEY_SPLIT  # the release default: the key split on (measured, config_decode)
    monkeypatch.setattr(CD, "DECODE_KEY_SPLIT", False)  # switched off: the 64-row tiles for every bucket
    config.clear_caches()
    for rows in (1, 4, 16, 17, 32, 64):
        assert CD.decode_tile(128, 128, rows) == FwdTile(64, 64, 4, 2)
        assert CD.decode_tile(256, 256, rows) == FwdTile(64, 32, 4, 2)
    assert CD.decode_tile(128, 128) == FwdTile(64, 64, 4, 2)
    monkeypatch.setattr(CD, "DECODE_KEY_SPLIT", True)
    config.clear_caches()
    picks = {rows: CD.decode_tile(128, 128, rows) for rows in (1, 16, 17, 32, 33, 64)}
    assert picks[1] == picks[16] == FwdTile(16, 64, 4, 2, kv_groups=4)
    assert picks[17] == picks[32] == FwdTile(32, 64, 4, 2, kv_groups=2)
    assert picks[33] == picks[64] == FwdTile(64, 64, 4, 2)
    assert CD.decode_tile(256, 256, 4) == CD.decode_tile(192, 128, 32) == FwdTile(32, 32, 4, 2, kv_groups=2)
    assert CD.decode_tile(256, 256, 40) == FwdTile(64, 32, 4, 2)
    assert CD.decode_tile(128, 128, 65) is None


def test_decode_rows_leave_a_full_grid_on_the_64_row_tile():
    from flash_attn_4_sm120 import config_decode as CD

    assert CD.decode_rows(4, 64, 132) == 4  # B=8 x Hkv 8: SMs idle, the key split takes the call (then splits)
    assert CD.decode_rows(32, 104, 132) == 32  # just under the auto-split test (4/5 of the SMs)
    assert CD.decode_rows(32, 106, 132) == CD.DECODE_MAX_ROWS
    assert CD.decode_rows(4, 512, 132) == CD.DECODE_MAX_ROWS  # B=64 x Hkv 8
    assert CD.decode_tile(128, 128, CD.decode_rows(4, 512, 132)).kv_groups == 1


def test_key_split_tiles_fit_their_merge_and_name_their_groups():
    from flash_attn_4_sm120 import config_decode as CD

    seen = set()
    for d, dv in config.supported_head_dim_pairs():
        for tile in CD.decode_tiles(d, dv):
            seen.add(tile.kv_groups)
            assert config.fwd_tile_problems(d, dv, tile) == []
            assert config.fwd_smem_bytes(d, dv, tile) <= config.SMEM_LIMIT_BYTES
            if tile.kv_groups > 1:  # the merge reuses the K/V stages
                assert config.key_split_merge_bytes(dv, tile) <= tile.num_stages * tile.tile_n * (d + dv) * 2
    assert seen == {1, 2, 4}
    assert FwdTile(32, 64, 4, 2, kv_groups=2).name() == "32x64w4s2k2"
    assert FwdTile(64, 64, 4, 2).name() == "64x64w4s2"
    # 3 groups do not divide 4 warps; TMA tiles have no key split; 16 keys per group at least
    assert "kv_groups=3" in "; ".join(config.fwd_tile_problems(128, 128, FwdTile(16, 64, 4, 2, kv_groups=3)))
    assert any("cp.async" in p for p in config.fwd_tile_problems(128, 128, FwdTile(32, 64, 8, 2, False, True, 2)))
    assert any("16 * kv_groups" in p for p in config.fwd_tile_problems(256, 256, FwdTile(16, 32, 4, 2, kv_groups=4)))
    # two groups at d256 with one stage of 32-key tiles: the merge (64 threads x 132 words) exceeds the K/V stages
    assert any("merge" in p for p in config.fwd_tile_problems(256, 256, FwdTile(32, 32, 4, 1, kv_groups=2)))


def test_deep_kv_pipelines_run_on_cp_async_only():
    """The cp.async kernel takes 1 to 5 K/V stages (tests/test_decode_gpu.py runs 3, 4 and 5); the TMA kernel's
    mbarrier pipeline 1 or 2; the budget still binds (3 stages of 64-key d128 tiles: 112 KB)."""
    assert config.fwd_tile_problems(128, 128, FwdTile(32, 32, 4, 5, kv_groups=2)) == []
    assert config.fwd_tile_problems(128, 128, FwdTile(64, 32, 4, 4)) == []
    assert any("num_stages=6" in p for p in config.fwd_tile_problems(128, 128, FwdTile(32, 16, 4, 6)))
    assert any("num_stages=3" in p for p in config.fwd_tile_problems(64, 64, FwdTile(128, 64, 8, 3, False, True)))
    assert any("shared memory" in p for p in config.fwd_tile_problems(128, 128, FwdTile(64, 64, 4, 3)))


def test_decode_plan_runs_the_key_split_tile_of_its_row_bucket(monkeypatch):
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import config_decode as CD
    from flash_attn_4_sm120 import jit

    monkeypatch.setattr(CD, "DECODE_KEY_SPLIT", True)
    config.clear_caches()
    for bucket, groups in ((16, 4), (32, 2), (64, 1)):
        cfg = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, False, False, False, False, True, False, 0,
                             decode=bucket)).fwd_cfg
        assert cfg.tile.kv_groups == groups and cfg.tile.tile_m == bucket
        assert jit.kernel_class(cfg).__name__ == ("FlashFwdDecode" if groups > 1 else "FlashFwdCpAsync")
        split = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, False, False, False, False, True, False, 0,
                               decode=bucket, split=True)).fwd_cfg
        assert split.split_kv and split.tile == cfg.tile


def test_unsupported_backward_raises_at_forward(monkeypatch):
    """The backward's kernels are chosen when a forward that needs gradients is planned (``plan.get_plan``, before
    the forward launches), so a training step never fails half-way: every served head-dim pair has both backward
    kernels, and where no backward tile fits (here: the d128 table left with a tile over SM120's shared memory) the
    planning of a forward that needs grad raises ValueError naming the head dims and the limit, while the same
    forward without grad plans and carries no backward config."""
    for dtype in config.DTYPES:
        for d, dv in config.supported_head_dim_pairs():
            plan = P.get_plan(P.PlanKey(dtype, d, dv, False, False, False, False, False, False, False, True, 0))
            assert plan.bwd_cfg is not None and plan.dq_cfg is not None, (dtype, d, dv)
    monkeypatch.setitem(config_bwd._BWD_TILES, 128, ((128, 128, 8),))
    config.clear_caches()
    with pytest.raises(ValueError, match=r"head_dim=128, head_dim_v=128: no backward tile fits SM120") as info:
        P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, True, 0))
    assert str(config.SMEM_LIMIT_BYTES) in str(info.value)
    plan = P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, False, 0))
    assert plan.bwd_cfg is None and plan.dq_cfg is None
