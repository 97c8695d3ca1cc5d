"""The score hook's shape (issue 30, a smaller hook), on a CPU: a score transform holding two components, masking
(kernels/score_mask.py ``Mask``) and dropout (kernels/score_dropout.py ``Dropout``), built from a kernel config the
way kernel_state.py builds them for every kernel.  That the kernels' code did not change with the split is checked
by SASS (benchmarks/results/sass_compare_score_components_d13c2ba.txt), not here."""

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("cutlass")

from flash_attn_4_sm120.kernels import score, score_dropout, score_mask  # noqa: E402


def _cfg(**kw):
    base = dict(has_softcap=False, windowed=True, has_dropout=False, mods=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _seq(seqlen_q=100, seqlen_k=130):
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, batch=0)


def test_the_hook_is_a_transform_holding_its_components():
    fields = {f.name for f in dataclasses.fields(score.ScoreHook)}
    assert fields == {"has_softcap", "scale_log2", "softcap_prescale", "mask", "dropout", "mods"}
    # no mixin: the dropout methods are the component's, and the P path has no dropout twins
    assert score_dropout.Dropout not in score.ScoreHook.__mro__
    assert not [n for n in vars(score.ScoreHook) if "dropout" in n and n != "dropout"], list(vars(score.ScoreHook))
    mask_fields = {f.name for f in dataclasses.fields(score_mask.Mask)}
    assert {"window_left", "window_right", "diag", "mask_mod", "gate"} <= mask_fields
    assert "rng" in {f.name for f in dataclasses.fields(score_dropout.Dropout)}


def test_mask_takes_the_mask_mod_and_aux_only_with_mods():
    seq = _seq()
    plain = score_mask.Mask.create(_cfg(), 64, seq, 5, 0, aux=("aux",))
    assert plain.mask_mod is None and plain.aux is None  # aux without mods is dropped, as before the split
    assert plain.diag == 30 and (plain.window_left, plain.window_right) == (5, 0)

    def keep_all(b, h, q, k, seqlen_info, aux_tensors):
        return q

    mods = SimpleNamespace(mask_mod=keep_all, score_mod=None)
    with_mod = score_mask.Mask.create(_cfg(mods=mods), 64, seq, 5, 0, aux=("aux",))
    assert with_mod.mask_mod is keep_all and with_mod.aux == ("aux",)
    hook = score.ScoreHook.create(_cfg(mods=mods, has_softcap=True), 1.5, 0.25, with_mod)
    assert hook.mods is mods and hook.has_softcap and hook.dropout is None and hook.seq is seq


def test_dropout_component_takes_the_config_variants():
    rng = SimpleNamespace(scale=1.25)
    d = score_dropout.Dropout.create(_cfg(has_dropout=True, dropout_packed=True, dropout_high_p=True), 64, rng,
                                     quad_ok=False, row_loop=False, group_loop=True)
    assert (d.packed, d.high_p, d.quad_ok, d.row_loop, d.group_loop, d.tile_n) == (True, True, False, False, True, 64)
    assert d.scale == 1.25 and d.sign_test is False
    # a backward config has neither forward flag
    d = score_dropout.Dropout.create(_cfg(has_dropout=True), 128, rng)
    assert (d.packed, d.high_p) == (False, False)


def test_hook_views_replace_only_the_mask():
    mask = score_mask.Mask.create(_cfg(), 64, _seq(), 5, 0)
    hook = score.ScoreHook.create(_cfg(), 1.5, 0.25, mask)
    t = hook.as_transposed()
    assert t.mask.transposed and not hook.mask.transposed and t.scale_log2 == 1.5
    h = hook.with_head_rows((0, 4, 2))
    assert h.mask.head_rows == (0, 4, 2) and hook.mask.head_rows is None
