"""The fused backward's V-in-registers tile at max(d, dv) = 256 (kernels/bwd_dkdv_vregs.py), the d256 default, on a
GPU: the default call takes it, its gradients meet the fp32 bar of tests/test_bwd_gpu.py (GQA, causal, window,
softcap, fp16, d != dv, varlen with empty sequences), with dropout it agrees with the kernel pair (the same keep
mask), and deterministic=True keeps the (bitwise reproducible) pair."""

import pytest
import torch

from bwd_gpu_helpers import rand_grad as _rand, spy_fused_plan as _spy
from test_bwd_gpu import check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flash_attn_4_sm120 import config_bwd, dispatch_bwd  # noqa: E402


@pytest.fixture
def trial(monkeypatch):
    """No trial switch: the tile is the d256 default (the autouse _fresh_tile_memo of conftest forgets the plans)."""
    monkeypatch.delenv(config_bwd.FUSED_TRIAL_ENV, raising=False)


def test_the_default_selects_the_tile(monkeypatch, trial):
    seen = _spy(monkeypatch)
    q, k, v = _rand(2, 113, 4, 256), _rand(2, 211, 2, 256, seed=1), _rand(2, 211, 2, 256, seed=2)
    check(q, k, v, causal=True)
    assert seen and isinstance(seen[0], config_bwd.BwdVRegsKernelConfig) and seen[0].fused_dq


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (255, 1023), (700, 300)])
def test_matches_reference(trial, hq, hkv, sq, sk):
    q, k, v = _rand(2, sq, hq, 256), _rand(2, sk, hkv, 256, seed=1), _rand(2, sk, hkv, 256, seed=2)
    check(q, k, v, causal=False)
    check(q, k, v, causal=True)
    check(q, k, v, window_size=(64, 16))


@pytest.mark.parametrize("dv", [64, 128, 192])
def test_head_dims_that_differ(trial, dv):
    q, k, v = _rand(2, 177, 4, 256), _rand(2, 301, 2, 256, seed=1), _rand(2, 301, 2, dv, seed=2)
    check(q, k, v, causal=True)


def test_fp16_softcap_window(trial):
    q, k, v = (_rand(2, 177, 4, 256, dtype=torch.float16, seed=s) for s in range(3))
    check(q, k, v, causal=True, softcap=5.0)
    check(q, k, v, window_size=(40, 0), softcap=5.0)


def test_dropout_agrees_with_the_pair(monkeypatch, trial):
    q, k, v = (_rand(2, 177, 4, 256, seed=s) for s in range(3))
    grads = []
    for on in (True, False):  # the tile (the default), then the pair (the fused plan hidden, as the pre-fused path)
        if not on:
            monkeypatch.setattr(dispatch_bwd, "fused_plan", lambda plan, device, relay=False: None)
        seen = _spy(monkeypatch)
        out = fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.2, dropout_seed=7)[0]
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        assert (seen[0] is not None) == on
    for a, b in zip(*grads):  # same keep mask: the gradients differ by accumulation order only
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-3


def test_varlen_with_empty_sequences(trial):
    lens_q, lens_k = [0, 17, 113, 1, 0, 64], [5, 17, 200, 0, 3, 64]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = _rand(sum(lens_q), 4, 256)
    k, v = _rand(sum(lens_k), 2, 256, seed=1), _rand(sum(lens_k), 2, 256, seed=2)
    grads = []
    for det in (False, True):  # the tile; the pair (deterministic=True: no relay at d256 by default)
        out = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=113,
                                        max_seqlen_k=200, causal=True, deterministic=det)[0]
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):  # the pair is checked against the reference in test_bwd_gpu.test_bwd_varlen
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item() + 1e-3


def test_deterministic_runs_the_pair_bitwise(monkeypatch, trial):
    """The tile has no relay form (config_bwd.vregs_problems): deterministic=True keeps the atomic-free pair."""
    seen = _spy(monkeypatch)
    q, k, v = _rand(2, 1024, 8, 256), _rand(2, 1024, 2, 256, seed=1), _rand(2, 1024, 2, 256, seed=2)
    g = torch.randn(2, 1024, 8, 256, device="cuda", dtype=torch.bfloat16)

    def grads(det):
        out = fa.flash_attn_func(q, k, v, causal=True, deterministic=det)[0]
        return torch.autograd.grad(out, (q, k, v), g)
    first = grads(True)
    assert seen[-1] is None
    for x, y in zip(first, grads(True)):
        assert torch.equal(x, y)
    for x, y in zip(grads(False), first):  # the tile against the pair: accumulation order only
        assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item() + 1e-3
    assert isinstance(seen[-1], config_bwd.BwdVRegsKernelConfig)


@pytest.mark.parametrize("name", ["alibi", "relative_bias", "document_causal", "causal"])
def test_library_mods(monkeypatch, trial, name):
    """Score and mask mods on the tile (tests/test_mods_gpu.py's cases and bar), GQA 4:2."""
    from test_mods_gpu import _case, _check

    seen = _spy(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(4)
    b, s, hq, hkv = 2, 150, 4, 2
    q = _rand(b, s, hq, 256, seed=5)
    k, v = _rand(b, s, hkv, 256, seed=6), _rand(b, s, hkv, 256, seed=7)
    mods, aux, mask, bias = _case(name, b, s, s, hq, gen)
    _check(q, k, v, mods, aux, mask, bias)
    assert isinstance(seen[0], config_bwd.BwdVRegsKernelConfig) and seen[0].mods is not None
