"""The cp.async selection of a device without TMA (SM80/SM86/SM89), forced on the proxy with
FA4_SM120_FORCE_CPASYNC=1 (device.py): forward, backward, paged and split-KV against the fp32 reference, and
proof that every forward plan the calls made is a cp.async one (and that without the hook the same call is not).

    python -m pytest -q tests/test_cpasync_gpu.py --timeout 900
"""

import pytest
import torch

from test_bwd_gpu import check as check_bwd
from test_fwd_gpu import _inputs, assert_close
from test_paged_gpu import Paged, check_dense_q

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")
from flash_attn_4_sm120 import device as DV, plan as P  # noqa: E402


@pytest.fixture
def plans(monkeypatch):
    """Forward plans the calls of a test make (their kernel configs)."""
    seen = []
    real = P.get_plan

    def spy(key):
        plan = real(key)
        seen.append(plan.fwd_cfg)
        return plan

    monkeypatch.setattr(P, "get_plan", spy)
    return seen


@pytest.fixture
def cpasync(monkeypatch, plans):
    """Forced cp.async selection; after the test, every forward plan it made was a cp.async one."""
    monkeypatch.setenv(DV.FORCE_CPASYNC_ENV, "1")
    yield plans
    assert plans, "no forward plan was made"
    tma = [c.name() for c in plans if c.tile.tma]
    assert tma == [], f"TMA tiles selected with {DV.FORCE_CPASYNC_ENV}=1: {tma}"


def test_without_the_hook_the_proxy_selects_tma(plans, monkeypatch):
    """The control: the same d128 call on the proxy runs a TMA tile when the hook is off (so the hook's effect
    below is real)."""
    monkeypatch.delenv(DV.FORCE_CPASYNC_ENV, raising=False)
    if not DV.device_caps(torch.device("cuda")).tma:
        pytest.skip("this GPU has no TMA: every selection is cp.async already")
    q, k, v = _inputs(1, 256, 256, 4, 4, 128, 128, torch.bfloat16)
    fa.flash_attn_func(q, k, v)
    assert any(c.tile.tma for c in plans)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 192), (192, 128), (96, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward(cpasync, d, dv, causal):
    q, k, v = _inputs(2, 333, 517, 8, 2, d, dv, torch.bfloat16)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_close(out, lse, q, k, v, causal=causal)


def test_forward_fp16_window(cpasync):
    q, k, v = _inputs(1, 300, 300, 4, 4, 64, 64, torch.float16)
    out, lse = fa.flash_attn_func(q, k, v, window_size=(48, 16), return_lse=True)
    assert_close(out, lse, q, k, v, window=(48, 16))


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward(cpasync, d, dv, causal):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, n, h, e, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for n, h, e in ((200, 4, d), (263, 2, d), (263, 2, dv)))
    check_bwd(q, k, v, causal=causal)


@pytest.mark.parametrize("page_size", [64, 128, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_paged(cpasync, page_size, causal):
    """Page sizes that are multiples of the TMA tile's tile_n run the TMA kernel on the proxy; here the cp.async
    kernel takes them."""
    pg = Paged([700, 1, 333], page_size, 2, 128, 128)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(3, 40, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, page_table=pg.table, seqused_k=pg.seqused,
                                         causal=causal, num_splits=1, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=causal)


@pytest.mark.parametrize("num_splits", [3, 0, None])
def test_split(cpasync, num_splits, monkeypatch):
    """Forced, automatic and default split counts on a decode-shaped call (B=1, one query row, 8K keys), which the
    automatic choice splits on any GPU of more than a few SMs.  The default is tried with the automatic default
    switched on (as shipped: splitkv.DEFAULT_SPLITS_AUTO)."""
    if num_splits is None:
        from flash_attn_4_sm120 import splitkv
        monkeypatch.setattr(splitkv, "DEFAULT_SPLITS_AUTO", True)
    q, k, v = _inputs(1, 1, 8192, 8, 2, 128, 128, torch.bfloat16)
    kw = {} if num_splits is None else dict(num_splits=num_splits)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True, **kw)
    assert_close(out, lse, q, k, v)
    assert any(c.split_kv for c in cpasync), "the call did not split"


def test_split_prefill_tile(cpasync):
    """A split call on the prefill tile (more query rows than a decode tile holds)."""
    q, k, v = _inputs(1, 300, 4096, 4, 4, 128, 128, torch.bfloat16)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, num_splits=4, return_lse=True)
    assert_close(out, lse, q, k, v, causal=True)
    assert any(c.split_kv and c.tile.tile_m == 128 for c in cpasync)


def test_forced_arch_of_another_device_is_refused_before_any_compile(monkeypatch, plans):
    caps = DV.device_caps(torch.device("cuda"))
    other = next(f.arch for f in DV.CAPABILITIES.values() if f.arch not in caps.archs)
    monkeypatch.setenv("CUTE_DSL_ARCH", other)
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, 64, torch.bfloat16)
    with pytest.raises(DV.UnsupportedDeviceError, match=f"CUTE_DSL_ARCH={other} does not run on .*compute capability"):
        fa.flash_attn_func(q, k, v)
    assert plans == []  # refused before any plan (and so before any compile)
