"""What a device without TMA (8.0 / 8.6 / 8.9: sm_80 cubins) selects where sm_80's register allocation spills and
sm_120a's does not, and what the compile gate's sm_80 worklist builds for it (CPU, no compile).

The seven configurations the sm_80 full run of 7c4925a spilled (benchmarks/results/gate_spill_probes_sm80_s33.jsonl
rebuilt them and the tiles that replaced them): such a device selects a tile that compiled without spills there, or
refuses the call (compat ``sparse_grad_without_tma``); a device with TMA keeps its selection.
"""

import itertools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from scripts import compile_gate as G  # noqa: E402

G._package()
from flash_attn_4_sm120 import block_sparse as BS, compat, config, config_bwd as CB, modspec, plan as P  # noqa: E402
from flash_attn_4_sm120.config import FwdTile  # noqa: E402

DOC = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
REL = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), True)
# the full run's seven failures (sm_80, 7c4925a): a device without TMA no longer selects them
SPILLED = ("bwd_bf16_d128v128_32x128w8t_vq_vk_mods-document-25e0533c",
           "bwd_bf16_d128v128_32x128w8t_vq_vk_uk_mods-document-25e0533c",
           "bwd_fp16_d96v96_64x128w8t_sparse1x1",
           "dq_bf16_d192v192_64x64w4_win_vq_vk_uq_uk_drop_seedt_mods-relative_bias-9f06a675_sinkg",
           "dq_bf16_d192v96_64x64w4_win_softcap_vq_vk_uq_uk_drop_seedt_sinkg",
           "dq_fp16_d192v96_64x64w4_win_softcap_vq_vk_uq_uk_drop_seedt_sinkg",
           "fwd_bf16_d192v192_64x16w4s1_win_sink_vq_vk_uq_uk_drop_seedt_dpack_mods-relative_bias-419dd549")
HEAVY = dict(windowed=True, has_softcap=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)


def test_the_dkdv_kernel_leaves_the_key_row_tile_for_aux_mods_on_dense_calls():
    flags = dict(varlen_q=True, varlen_k=True, mods=DOC)
    assert CB.select_bwd_config("bf16", 128, 128, **flags).kv_rows  # sm_120a keeps it
    cfg = CB.select_bwd_config("bf16", 128, 128, False, **flags)
    assert (cfg.tile_m, cfg.tile_n, cfg.kv_rows) == (32, 128, False)  # same shape, P/dS tile
    # block-sparse calls with it compiled without spills on the key-row tile and keep it
    assert CB.select_bwd_config("bf16", 128, 128, False, **flags, sparse_q_ratio=1, sparse_kv_ratio=1).kv_rows
    # no aux tensors (causal mask mod), or no mod: the key-row tile
    assert CB.select_bwd_config("bf16", 128, 128, False, varlen_q=True, varlen_k=True).kv_rows


def test_dq_with_dropout_at_192_runs_64x32_without_tma():
    for dv in (96, 192):
        for kw in (dict(has_dropout=True), dict(HEAVY, has_dropout=True, dropout_seed_tensor=True, sink_grad=True)):
            assert (CB.select_dq_config("bf16", 192, dv, **kw).tile_n) == 64
            cfg = CB.select_dq_config("bf16", 192, dv, False, **kw)
            assert (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.split_kv_wait) == (64, 32, 4, True)
    with_mods = CB.select_dq_config("bf16", 192, 192, False, has_dropout=True, mods=REL)
    assert with_mods.tile_n == 32 and not with_mods.split_kv_wait  # (dropout with a mod never waits split)
    assert CB.select_dq_config("bf16", 192, 192, False).tile_n == 64  # no dropout: the table's tile
    assert CB.select_dq_config("bf16", 128, 128, False, has_dropout=True) == CB.select_dq_config(
        "bf16", 128, 128, has_dropout=True)


def test_forward_mods_with_dropout_at_192_runs_two_stages_without_tma():
    assert config.mods_dropout_fwd_tile(192, 192) == FwdTile(64, 16, 4, 1)
    assert config.mods_dropout_fwd_tile(192, 192, tma=False) == FwdTile(64, 16, 4, 2)
    assert config.mods_dropout_fwd_tile(192, 128, tma=False) == FwdTile(64, 16, 4, 2)
    with pytest.raises(ValueError, match="no TMA"):  # dv96: 16 key rows do not fit the copy, the TMA tile would
        config.mods_dropout_fwd_tile(192, 96, tma=False)
    key = P.PlanKey("bf16", 192, 192, True, False, True, True, True, True, True, False, 0, dropout=True,
                    dropout_packed=True, mods=REL.forward_part(), tma=False)
    assert P.get_plan(key).fwd_cfg.tile == FwdTile(64, 16, 4, 2)


def test_sparse_grad_without_tma_is_refused_where_no_tile_of_its_shape_fits():
    key = dict(sparse=(1, 1, 128, 128), sparse_bwd=(1, 1, 1, 1))
    args = (96, 96, False, False, False, False, False, False, False, True, 0)
    with pytest.raises(ValueError, match=r"fp16 at head_dim=96, head_dim_v=96 cannot run on a device without TMA "
                                         r"\(compute capability 8\.0 / 8\.6 / 8\.9.*64x128.*torch\.no_grad"):
        P.get_plan(P.PlanKey("fp16", *args, tma=False, **key))
    assert P.get_plan(P.PlanKey("bf16", *args, tma=False, **key)).bwd_cfg.kv_rows  # bf16 runs
    assert P.get_plan(P.PlanKey("fp16", *args, tma=True, **key)).bwd_cfg.kv_rows  # TMA devices run
    no_grad = args[:-2] + (False, 0)
    assert P.get_plan(P.PlanKey("fp16", *no_grad, tma=False, sparse=key["sparse"])).fwd_cfg  # inference runs
    assert compat.CONFLICTS["sparse_grad_without_tma"].limit == "config_bwd.select_bwd_config"


def test_the_refusal_comes_through_the_public_call_before_any_launch():
    import stub_device
    import flash_attn_4_sm120 as fa

    launched = []
    q, k, v = (torch.randn(1, 256, 2, 96, dtype=torch.float16, requires_grad=True) for _ in range(3))
    bst = fa.block_sparse_from_mask(torch.ones(1, 2, 2, 2, dtype=torch.bool), (128, 128))
    with stub_device.stubbed_device("SM86 (test)", (8, 6), 84, lambda cfg, dev: cfg,
                                    lambda fn, record, dev, values: launched.append(fn)):
        with pytest.raises(ValueError, match=r"fp16 at head_dim=96, head_dim_v=96 cannot run on a device without TMA"):
            fa.flash_attn_func(q, k, v, block_sparse_tensors=bst)
    assert launched == []


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sparse_backward_tiles_have_the_shape_block_sparse_checks(dtype):
    """Without TMA, a block-sparse call that needs grad runs a dK/dV tile of the shape block_sparse computes its
    ratios for (block_sparse._bwd_tiles), or is refused: never another shape, which would read the lists with
    other block sizes."""
    names = ("windowed", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k")
    for d, dv in config.supported_head_dim_pairs():
        for mods in (None, DOC, REL):
            try:
                want = BS._bwd_tiles(d, dv, mods)[0]
            except ValueError:  # refused with TMA too (d256 with a mask mod)
                want = None
            for bits in itertools.product((False, True), repeat=len(names)):
                try:
                    cfg = CB.select_bwd_config(dtype, d, dv, False, mods=mods, sparse_q_ratio=1, sparse_kv_ratio=1,
                                               **dict(zip(names, bits)))
                except ValueError as exc:
                    assert "without TMA" in str(exc) or want is None or dtype == "fp16" and d == 256, exc
                    continue
                assert (cfg.tile_m, cfg.tile_n) == (want.tile_m, want.tile_n), (d, dv, mods, bits, cfg.name())


def test_tma_devices_keep_every_selection():
    """The seven spilling configurations are still what a TMA device selects (sm_120a compiled them without
    spills): the reroutes apply without TMA only."""
    assert CB.select_bwd_config("bf16", 128, 128, varlen_q=True, varlen_k=True, mods=DOC).name() == \
        SPILLED[0].replace("_mods-document-25e0533c", "") + "_mods" + DOC.tag()
    assert CB.select_bwd_config("fp16", 96, 96, sparse_q_ratio=1, sparse_kv_ratio=1).name() == SPILLED[2]
    assert CB.select_dq_config("fp16", 192, 96, has_dropout=True, dropout_seed_tensor=True, sink_grad=True,
                               **HEAVY).name() == SPILLED[5]


def test_the_sm80_worklist_builds_the_reroutes_not_the_spilled_tiles():
    names = {c.name() for c in G._worklist(None, "sm_80")}
    assert not names & set(SPILLED)
    for new in ("bwd_bf16_d128v128_32x128w8_vq_vk_mods-document-25e0533c",
                "bwd_bf16_d128v128_32x128w8_vq_vk_uk_mods-document-25e0533c",
                "dq_bf16_d192v192_64x32w4_win_vq_vk_uq_uk_drop_seedt_mods-relative_bias-9f06a675_sinkg",
                "dq_bf16_d192v96_64x32w4_win_softcap_vq_vk_uq_uk_drop_seedt_kw_sinkg",
                "dq_fp16_d192v96_64x32w4_win_softcap_vq_vk_uq_uk_drop_seedt_kw_sinkg",
                "fwd_bf16_d192v192_64x16w4s2_win_sink_vq_vk_uq_uk_drop_seedt_dpack_mods-relative_bias-419dd549"):
        assert new in names, new
    # the refused fp16 d96 block-sparse backward is not built (its inference forward is)
    assert not [n for n in names if n.startswith(("bwd_fp16_d96", "dq_fp16_d96")) and "_sparse" in n]
    assert [n for n in names if n.startswith("fwd_fp16_d96v96") and "_sparse" in n]


def test_the_sm80_worklist_builds_no_backward_a_device_without_tma_does_not_select():
    """Every dK/dV and dQ configuration of the sm_80 worklist that the TMA selection gives for its flags is also
    what a device without TMA selects for them (the gate maps the hand-made lists through it)."""
    for cfg in G._worklist(None, "sm_80"):
        if not isinstance(cfg, CB.BwdKernelConfig) or cfg.fused_dq:
            continue
        flags = {f: getattr(cfg, f) for f in G._BWD_FLAGS}
        if isinstance(cfg, CB.DqKernelConfig):
            select, flags = CB.select_dq_config, dict(flags, sink_grad=cfg.sink_grad)
        else:
            select = CB.select_bwd_config
        if select(cfg.dtype, cfg.head_dim, cfg.head_dim_v, **flags) == cfg:
            assert select(cfg.dtype, cfg.head_dim, cfg.head_dim_v, False, **flags) == cfg, cfg.name()
