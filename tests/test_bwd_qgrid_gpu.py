"""The fused backward with its S/dP warps 2 x 4 (config_bwd ``q_warp_rows`` = 32 on the d64 64x128 tile), forced
through the fused table as benchmarks/experiments/bwd_fused_ab.py --fused-tile does: the call runs that grid, its
gradients meet the fp32 bar (tests/test_bwd_gpu.py's check), and, since every S/dP element is the same k16 mma
chain and the same elementwise score code on either grid while dK, dV and dQ keep their grids, its relay form
(deterministic=True) gives gradients bitwise equal to the 16-row grid's, with dropout, softcap, varlen, a score mod
and a mask mod."""

import pytest
import torch

from bwd_gpu_helpers import rand_grad as _rand, spy_fused_plan, times_two_mods
from test_bwd_gpu import check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flash_attn_4_sm120 import config, config_bwd  # noqa: E402

Q32 = (64, 128, 8, 32, "q32")
Q16 = (64, 128, 8, 32)


def _force(monkeypatch, tile, configs):
    """The d64 fused table reduced to ``tile`` (every walk); ``configs`` records each call's fused configuration."""
    monkeypatch.setitem(config_bwd._FUSED_TILES, 64, ((tile, "all"),))
    config.clear_caches()  # plans and tile choices memoised under the previous table
    spy_fused_plan(monkeypatch, configs)


def _ran_q32(configs):
    return bool(configs) and all(c is not None and c.q_warp_rows == 32 for c in configs)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (255, 1023), (700, 300)])
def test_q32_matches_reference(monkeypatch, hq, hkv, sq, sk):
    configs = []
    _force(monkeypatch, Q32, configs)
    q, k, v = _rand(2, sq, hq, 64), _rand(2, sk, hkv, 64, seed=1), _rand(2, sk, hkv, 64, seed=2)
    check(q, k, v, causal=False)
    check(q, k, v, causal=True)
    check(q, k, v, window_size=(32, 16))
    check(q, k, v, causal=True, deterministic=True)
    assert _ran_q32(configs), configs


def test_q32_fp16_softcap(monkeypatch):
    configs = []
    _force(monkeypatch, Q32, configs)
    q, k, v = (_rand(2, 177, 4, 64, dtype=torch.float16, seed=s) for s in range(3))
    check(q, k, v, causal=True, softcap=5.0)
    check(q, k, v, window_size=(40, 7), softcap=3.0)
    assert _ran_q32(configs), configs


def _cases():
    """(name, call, inputs) through the relay form (deterministic=True)."""
    from flash_attn_4_sm120 import mods as M

    lens_q, lens_k = [0, 17, 1113, 1, 0, 640], [5, 17, 2000, 0, 3, 640]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    dense = (_rand(2, 1000, 8, 64), _rand(2, 1500, 2, 64, seed=1), _rand(2, 1500, 2, 64, seed=2))
    half = tuple(_rand(2, 333, 4, 64, dtype=torch.float16, seed=s) for s in range(3))
    times_two, times_two_bwd = times_two_mods()
    return [
        ("dense", lambda q, k, v: fa.flash_attn_func(q, k, v, deterministic=True), dense),
        ("causal", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, deterministic=True), dense),
        ("window", lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=(300, 64), deterministic=True), dense),
        ("dropout", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.15, dropout_seed=3,
                                                       deterministic=True), dense),
        ("fp16-softcap", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, softcap=5.0, deterministic=True),
         half),
        # a score mod (its backward reads the raw scores) and a mask mod; aux-reading mods spill the q32 tile
        # (config_bwd._BWD_SPILLING), which refuses them
        ("score-mod", lambda q, k, v: fa.flash_attn_func(q, k, v, score_mod=times_two, score_mod_bwd=times_two_bwd,
                                                         deterministic=True), dense),
        ("mask-mod", lambda q, k, v: fa.flash_attn_func(q, k, v, deterministic=True, **M.causal()), dense),
        ("varlen", lambda q, k, v: fa.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1113, max_seqlen_k=2000, causal=True,
            deterministic=True),
         (_rand(sum(lens_q), 8, 64), _rand(sum(lens_k), 1, 64, seed=1), _rand(sum(lens_k), 1, 64, seed=2))),
    ]


def _grads(call, inputs, g):
    out = call(*inputs)[0]
    return torch.autograd.grad(out, inputs, g)


def test_q32_relay_is_bitwise_the_16_row_grid(monkeypatch):
    for name, call, inputs in _cases():
        g = torch.randn_like(call(*inputs)[0])
        runs = {}
        for tile in (Q16, Q32):
            configs = []
            with monkeypatch.context() as m:
                _force(m, tile, configs)
                runs[tile] = _grads(call, inputs, g)
            config.clear_caches()
            assert configs and all(c is not None and c.dq_relay for c in configs), (name, tile, configs)
            assert all(c.q_warp_rows == (32 if tile == Q32 else 16) for c in configs), (name, tile, configs)
        for tag, a, b in zip(("dq", "dk", "dv"), runs[Q32], runs[Q16]):
            assert torch.isfinite(a).all(), (name, tag)
            assert torch.equal(a, b), (name, tag, (a.float() - b.float()).abs().max().item())


def test_q32_default_mode_dk_dv_bitwise_dq_within_bar(monkeypatch):
    """Without the relay only dQ's adds change order; dK and dV stay bitwise those of the 16-row grid."""
    q, k, v = _rand(2, 1000, 8, 64), _rand(2, 1500, 2, 64, seed=1), _rand(2, 1500, 2, 64, seed=2)
    g = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for tile in (Q16, Q32):
        configs = []
        with monkeypatch.context() as m:
            _force(m, tile, configs)
            out = fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, dropout_seed=9)[0]
            runs[tile] = torch.autograd.grad(out, (q, k, v), g)
        config.clear_caches()
        assert configs and all(c is not None and not c.dq_relay for c in configs), (tile, configs)
    a, b = runs[Q32], runs[Q16]
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert (a[0].float() - b[0].float()).abs().max().item() <= 1e-2 * b[0].float().abs().max().item() + 1e-3
