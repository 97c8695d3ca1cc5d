"""score_mod / mask_mod / aux_tensors on a CPU: argument checks (before any launch), the compile key (identity and
source of a mod, dtype/rank of aux tensors; a repeated mod never recompiles), and the library mods compiling to
sm_120a without spills (through the compile gate)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

fa = pytest.importorskip("flash_attn_4_sm120")
from flash_attn_4_sm120 import config, config_bwd, jit, modspec, plan as P  # noqa: E402
from scripts import gate_lists as GL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def score_a(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score


def score_a_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return grad


def mask_a(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return q_idx >= kv_idx


def _check(**kw):
    args = dict(score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, device=CPU,
                needs_grad=False)
    args.update(kw)
    return modspec.check_mods(**args)


# ---- argument checks
@pytest.mark.parametrize("kw,needle", [
    (dict(score_mod_bwd=score_a_bwd), "score_mod_bwd was given without score_mod"),
    (dict(aux_tensors=[torch.zeros(3)]), "aux_tensors were given without score_mod or mask_mod"),
    (dict(score_mod=score_a, needs_grad=True), "needs score_mod_bwd"),
    (dict(score_mod=mask_a), "takes 6 positional arguments"),
    (dict(mask_mod=score_a), "takes 7 positional arguments"),
    (dict(score_mod=score_a, score_mod_bwd=score_a, needs_grad=True), "takes 7 positional arguments"),
    (dict(mask_mod=42), "must be a @cute.jit callable"),
    (dict(mask_mod=mask_a, aux_tensors=torch.zeros(3)), "list or tuple of tensors"),
    (dict(mask_mod=mask_a, aux_tensors=[3]), "aux_tensors[0] must be a torch.Tensor"),
    (dict(mask_mod=mask_a, aux_tensors=[torch.zeros(())]), "rank >= 1"),
    (dict(mask_mod=mask_a, aux_tensors=[torch.zeros(3, dtype=torch.complex64)]), "dtype"),
    (dict(mask_mod=mask_a, aux_tensors=[torch.zeros(4, 6)[:, ::2]]), "contiguous last dim"),
    (dict(mask_mod=mask_a, aux_tensors=[torch.zeros(3)] * 9), "9 tensors"),
])
def test_bad_mod_arguments_raise_value_error(kw, needle):
    with pytest.raises(ValueError) as info:
        _check(**kw)
    assert needle in str(info.value), str(info.value)


def test_vec_size_is_checked():
    def wide(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score

    wide.__vec_size__ = 4
    with pytest.raises(ValueError, match="__vec_size__=4"):
        _check(score_mod=wide)


def test_softcap_with_score_mod_raises_before_launch_through_the_api():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):
        fa.flash_attn_func(q, q, q, softcap=3.0, score_mod=score_a)


def test_dropout_with_mods_plans_the_gated_kernels():
    """dropout_p with a score_mod runs kernels compiled with both (forward, packed forward, dK/dV, dQ), on the
    forward tile config.mods_dropout_fwd_tile gives, and those tiles are the ones the compile gate builds for
    mods x dropout (GL.mods_dropout_worklist)."""
    from flash_attn_4_sm120 import dispatch

    gate = GL.mods_dropout_worklist()
    fwd_tiles = {(max(c.head_dim, c.head_dim_v), c.tile) for c in gate if isinstance(c, config.FwdKernelConfig)}
    bwd_tiles = {(type(c).__name__, c.head_dim, c.tile_m, c.tile_n, c.num_warps, c.kv_warp_rows)
                 for c in gate if not isinstance(c, config.FwdKernelConfig)}
    assert all(c.has_dropout and c.mods is not None for c in gate)
    spec, _ = _check(score_mod=score_a, score_mod_bwd=score_a_bwd, aux_tensors=[torch.zeros(3, 4)],
                     needs_grad=True)
    for d, dv in config.supported_head_dim_pairs():
        if max(d, dv) > config.MODS_DROPOUT_MAX_HEAD_DIM:
            continue
        for windowed in (False, True):
            for packed in (False, True):
                plan = P.get_plan(P.PlanKey("bf16", d, dv, windowed, False, False, False, False, False, False, True, None,
                                      dropout=True, seed_tensor=True, dropout_packed=packed, mods=spec))
                f = plan.fwd_cfg
                assert f.has_dropout and f.dropout_packed == packed and f.mods == spec.forward_part()
                assert f.tile == config.mods_dropout_fwd_tile(d, dv)
                assert not config.fwd_tile_problems(d, dv, f.tile)
                # gated at the largest head dim that runs it (the most registers)
                assert any(t == f.tile and gd >= max(d, dv) for gd, t in fwd_tiles), (d, dv, f.tile)
                for c in (plan.bwd_cfg, plan.dq_cfg):
                    assert c.has_dropout and c.mods == spec
                    if d == dv and d in (64, 128, 192):
                        key = (type(c).__name__, d, c.tile_m, c.tile_n, c.num_warps, c.kv_warp_rows)
                        assert key in bwd_tiles, c.name()


@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
def test_dropout_with_mods_at_d256_raises_before_launch_through_the_api(which):
    """No d = 256 forward tile carries mods and dropout without spills: ValueError naming both and the head dims
    (p = 0 and p = 1 run the kernels without dropout, so they are not refused)."""
    q = torch.zeros(1, 4, 2, 256, dtype=torch.bfloat16)
    mods = dict(score_mod=score_a) if which == "score_mod" else dict(mask_mod=mask_a)
    with pytest.raises(ValueError, match="score_mod/mask_mod needs max.head_dim, head_dim_v. <= 192") as info:
        fa.flash_attn_func(q, q, q, dropout_p=0.1, **mods)
    assert "head_dim=256" in str(info.value) and "dropout_p" in str(info.value)
    with pytest.raises(ValueError, match="<= 192"):
        config.mods_dropout_fwd_tile(256, 32)
    for p in (0.0, 1.0):  # passes the mods x dropout check; stops later at the device check (CPU tensors)
        with pytest.raises(ValueError) as info:
            fa.flash_attn_func(q, q, q, dropout_p=p, **mods)
        assert "<= 192" not in str(info.value)


def test_mask_mod_alone_takes_no_bwd_and_softcap_is_fine():
    spec, aux = _check(mask_mod=mask_a, needs_grad=True)
    assert spec.mask_mod is mask_a and spec.score_mod is None and aux == ()


def test_vec_size_defaults_follow_upstream():
    spec, _ = _check(score_mod=score_a)
    assert spec.score_vec == 2  # no aux tensors
    spec, _ = _check(score_mod=score_a, aux_tensors=[torch.zeros(2)])
    assert spec.score_vec == 1


# ---- compile key
def test_key_identity_and_source():
    a, _ = _check(score_mod=score_a)
    b, _ = _check(score_mod=score_a)
    assert a == b and hash(a) == hash(b)

    def score_b(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score * 2

    c, _ = _check(score_mod=score_b)
    assert c != a


def test_closures_key_by_value():
    def factory(w):
        def m(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
            return q_idx - kv_idx <= w

        return m

    assert _check(mask_mod=factory(8))[0] == _check(mask_mod=factory(8))[0]
    assert _check(mask_mod=factory(8))[0] != _check(mask_mod=factory(9))[0]


def test_unhashable_closure_keys_by_identity():
    table = [1, 2]

    def m(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return table

    k1 = _check(mask_mod=m)[0]
    table2 = [1, 2]  # noqa: F841 - a different list object

    def factory():
        t = [1, 2]

        def m2(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
            return t

        return m2

    assert k1 == _check(mask_mod=m)[0]
    assert _check(mask_mod=factory())[0] != _check(mask_mod=factory())[0]


def test_aux_tensors_enter_by_dtype_and_rank_not_data():
    f32 = _check(mask_mod=mask_a, aux_tensors=[torch.zeros(3)])[0]
    assert f32 == _check(mask_mod=mask_a, aux_tensors=[torch.ones(17)])[0]
    assert f32 != _check(mask_mod=mask_a, aux_tensors=[torch.zeros(3, dtype=torch.int32)])[0]
    assert f32 != _check(mask_mod=mask_a, aux_tensors=[torch.zeros(3, 1)])[0]


def test_forward_key_ignores_score_mod_bwd():
    full, _ = _check(score_mod=score_a, score_mod_bwd=score_a_bwd, needs_grad=True)
    fwd_only, _ = _check(score_mod=score_a)
    assert full != fwd_only and full.forward_part() == fwd_only


def test_repeated_mod_compiles_once(monkeypatch):
    """Equal specs (the same mod, or a new closure of the same source and values) hit one compiled kernel."""
    monkeypatch.setenv("FA4_SM120_DISK_CACHE", "0")
    calls = []
    monkeypatch.setattr(jit, "_MEMORY", {})
    tile = config.select_fwd_tile(64, 64, False)

    def fake_compile(cfg):
        calls.append(cfg)
        return object()

    monkeypatch.setattr(jit, "target_arch", lambda: "sm_120a")
    for w in (8, 8, 8, 9):
        from flash_attn_4_sm120 import mods

        spec, _ = _check(**mods.sliding_window(w, 0))
        cfg = config.FwdKernelConfig("bf16", 64, 64, tile, mods=spec)
        jit.cached_kernel((jit.kernel_class(cfg).__name__, cfg, jit.target_arch()), cfg, fake_compile)
    assert len(calls) == 2


def test_user_mods_skip_the_disk_cache_library_mods_use_it():
    from flash_attn_4_sm120 import mods

    assert _check(mask_mod=mask_a)[0].disk_cacheable is False
    assert _check(**mods.causal())[0].disk_cacheable is True


def test_config_names_and_records():
    from flash_attn_4_sm120 import mods

    spec, _ = _check(**mods.alibi(), aux_tensors=[torch.zeros(4)])
    cfg = config.FwdKernelConfig("bf16", 64, 64, config.select_fwd_tile(64, 64, False), mods=spec)
    assert "mods-alibi" in cfg.name() and cfg.has_aux
    bwd = config_bwd.select_bwd_config("bf16", 64, 64, mods=spec)
    assert "mods-alibi" in bwd.name() and bwd.has_aux
    assert config.mods_tile(config.FwdTile(64, 64, 4, 1, False), 256, 256) == config.FwdTile(64, 16, 4, 1, False)


def test_mods_tile_fits_every_head_dim_pair_or_raises():
    """The d = 256 fallback tile must fit the copies of the pair: 64x16 where 16 key rows divide the V copy, 64x32
    at dv = 32 (gated), and a ValueError at dv = 96 (64x32 and 64x64 spill there with mods)."""
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            for paged in (False, True):
                base = config.select_fwd_tile(d, dv, windowed, paged)
                if (d, dv) == (256, 96):
                    with pytest.raises(ValueError, match="head_dim=256, head_dim_v=96"):
                        config.mods_tile(base, d, dv)
                    continue
                tile = config.mods_tile(base, d, dv)
                assert not config.fwd_tile_problems(d, dv, tile), (d, dv, tile)
                split = config.mods_tile(config.split_tile(base), d, dv)
                assert not config.fwd_tile_problems(d, dv, split), (d, dv, split)
    assert config.mods_tile(config.FwdTile(64, 64, 4, 1, False), 256, 32) == config.FwdTile(64, 32, 4, 1, False)
    gated = {(c.head_dim, c.head_dim_v, c.tile) for c in GL.mods_worklist()
             if isinstance(c, config.FwdKernelConfig) and not c.has_dropout}
    assert (256, 32, config.FwdTile(64, 32, 4, 1, False)) in gated


def test_library_specs_pickle_by_recipe():
    import pickle

    from flash_attn_4_sm120 import mods

    spec, _ = _check(**mods.relative_bias(8), aux_tensors=[torch.zeros(2, 17)], needs_grad=True)
    back = pickle.loads(pickle.dumps(spec)).resolved()
    assert back == spec and back.score_mod_bwd is not None
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(_check(mask_mod=mask_a)[0])


def test_library_factories_check_their_arguments():
    from flash_attn_4_sm120 import mods

    for bad in (lambda: mods.sliding_window(-1), lambda: mods.sliding_window(2.5), lambda: mods.prefix_lm(-3),
                lambda: mods.relative_bias(True), lambda: mods.document(causal=1)):
        with pytest.raises(ValueError):
            bad()


def test_document_ids_from_offsets():
    from flash_attn_4_sm120 import mods

    ids = mods.document_ids(torch.tensor([0, 2, 2, 5], dtype=torch.int32), 7)
    assert ids.tolist() == [0, 0, 2, 2, 2, -1, -1] and ids.dtype == torch.int32


# ---- sm_120a compile (CPU: fake tensors, real cubins)
def _gate(pattern: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUTE_DSL_ARCH="sm_120a")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_gate.py"), "--filter", pattern,
                           "--jobs", "2"], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pattern", ["fwd_bf16_d64v64_256x64w8s2t_mods-relative_bias",
                                     "bwd_bf16_d128v128_32x128w8_win_vq_vk_uq_uk_mods-document",
                                     "dq_bf16_d256v256_64x32w4_win_vq_vk_uq_uk_mods-alibi"])
def test_library_mods_compile_for_sm120_without_spills(pattern):
    res = _gate(pattern)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1/1 configurations pass" in res.stdout


@pytest.mark.timeout(600)
def test_a_mod_that_does_not_compile_names_itself():
    code = r"""
import sys
sys.path.insert(0, sys.argv[1])
import compile_gate
compile_gate._package()
import cutlass.cute as cute
from flash_attn_4_sm120 import config, config_bwd, jit, modspec

@cute.jit
def broken_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return q_idx.no_such_method()

spec = modspec.make_mod_spec(mask_mod=broken_mask)
cfg = config.FwdKernelConfig("bf16", 64, 64, config.select_fwd_tile(64, 64, False), mods=spec)
try:
    jit.compile_kernel(cfg)
except jit.ModCompileError as exc:
    print("RAISED", exc)
"""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_120a")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert "RAISED" in res.stdout and "broken_mask" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
