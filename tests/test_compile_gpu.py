"""torch.compile(fullgraph=True) of a model using the attention: no graph breaks, same results as eager,
forward and backward, and both within the tests' bar of an fp32 reference of the same model (tests/reference.py)."""

import pytest
import torch
import torch.nn as nn

from reference import attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


class Attn(nn.Module):
    def __init__(self, dm=256, hq=4, hkv=2, **kw):
        super().__init__()
        self.hq, self.hkv, self.dh, self.kw = hq, hkv, dm // hq, kw
        self.qkv = nn.Linear(dm, (hq + 2 * hkv) * self.dh, bias=False)
        self.out = nn.Linear(hq * self.dh, dm, bias=False)

    def forward(self, x, upcast=None):
        """``upcast`` None: our attention; True / False: the reference attention in fp32 / in the input dtype."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.dh).split([self.hq, self.hkv, self.hkv], dim=2)
        if upcast is None:
            y, lse = fa.flash_attn_func(q, k, v, return_lse=True, **self.kw)
        else:
            ref_kw = {("window" if key == "window_size" else key): val for key, val in self.kw.items()}
            y, lse = attention_ref(q, k, v, upcast=upcast, **ref_kw)
        return self.out(y.reshape(b, s, -1)), lse


def _loss(y, lse):
    return y.float().square().mean() + lse.mean()


def _run(model, x, **kw):
    """(y, lse, gradients of the parameters and of x) of one forward + backward of ``model``."""
    x = x.detach().clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    y, lse = model(x, **kw)
    _loss(y, lse).backward()
    return y.detach(), lse.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _within_bar(name, ours, ref, pt):
    """The tests' bar: max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol."""
    assert torch.isfinite(ours).all(), f"{name}: non-finite"
    err = (ours.float() - ref.float()).abs().max().item()
    err_pt = (pt.float() - ref.float()).abs().max().item()
    atol = 1e-3 * ref.float().abs().max().item() + 1e-12  # relative: the gradients here are ~1e-4 in size
    assert err <= 2 * err_pt + atol, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {atol:.1e}"


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(32, 8), softcap=20.0)])
def test_compile_fullgraph_forward_backward(kw):
    torch.manual_seed(0)
    model = Attn(**kw).cuda().to(torch.bfloat16)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    y_eager, lse_eager, grads_eager = _run(model, x)
    y_c, lse_c, grads_c = _run(torch.compile(model, fullgraph=True), x)
    assert torch.allclose(y_c.float(), y_eager.float(), atol=2e-2, rtol=0)
    assert torch.allclose(lse_c, lse_eager, atol=1e-3, rtol=0)
    for a, b in zip(grads_c, grads_eager):
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=5e-2)
    # the yardsticks: the same model with the reference attention, in fp32 (weights and input upcast) and in bf16
    ref_model = Attn(**kw).cuda().float()
    ref_model.load_state_dict({key: val.float() for key, val in model.state_dict().items()})
    y_ref, lse_ref, grads_ref = _run(ref_model, x.float(), upcast=True)
    y_pt, lse_pt, grads_pt = _run(model, x, upcast=False)
    names = [n for n, _ in model.named_parameters()] + ["x"]
    for label, (y, lse, grads) in (("compiled", (y_c, lse_c, grads_c)), ("eager", (y_eager, lse_eager, grads_eager))):
        _within_bar(f"{label} out", y, y_ref, y_pt)
        _within_bar(f"{label} lse", lse, lse_ref, lse_pt)
        for name, a, r, p in zip(names, grads, grads_ref, grads_pt):
            _within_bar(f"{label} d{name}", a, r, p)


def test_ops_are_registered_with_fake_impls():
    from flash_attn_4_sm120 import ops

    q = torch.randn(2, 10, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 12, 2, 64, device="cuda", dtype=torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        out, lse, _rng = ops.fwd(fq, fk, fk, None, None, None, None, None, None, None, None, True, None, None, 0.0, None, None)
        assert out.shape == (2, 10, 4, 64) and lse.shape == (2, 4, 10) and lse.dtype == torch.float32
