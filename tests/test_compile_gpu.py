"""torch.compile(fullgraph=True) of a model using the attention: no graph breaks, same results as eager,
forward and backward."""

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


class Attn(nn.Module):
    def __init__(self, dm=256, hq=4, hkv=2, **kw):
        super().__init__()
        self.hq, self.hkv, self.dh, self.kw = hq, hkv, dm // hq, kw
        self.qkv = nn.Linear(dm, (hq + 2 * hkv) * self.dh, bias=False)
        self.out = nn.Linear(hq * self.dh, dm, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, self.dh).split([self.hq, self.hkv, self.hkv], dim=2)
        y, lse = fa.flash_attn_func(q, k, v, return_lse=True, **self.kw)
        return self.out(y.reshape(b, s, -1)), lse


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(32, 8), softcap=20.0)])
def test_compile_fullgraph_forward_backward(kw):
    torch.manual_seed(0)
    model = Attn(**kw).cuda().to(torch.bfloat16)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_eager, lse_eager = model(x)
    (y_eager.float().square().mean() + lse_eager.mean()).backward()
    grads_eager = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    for p in model.parameters():
        p.grad = None
    x.grad = None
    compiled = torch.compile(model, fullgraph=True)
    y_c, lse_c = compiled(x)
    (y_c.float().square().mean() + lse_c.mean()).backward()
    grads_c = [p.grad for p in model.parameters()] + [x.grad]
    assert torch.allclose(y_c.float(), y_eager.float(), atol=2e-2, rtol=0)
    assert torch.allclose(lse_c, lse_eager, atol=1e-3, rtol=0)
    for a, b in zip(grads_c, grads_eager):
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=5e-2)


def test_ops_are_registered_with_fake_impls():
    from flash_attn_4_sm120 import ops

    q = torch.randn(2, 10, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 12, 2, 64, device="cuda", dtype=torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        out, lse, _rng = ops.fwd(fq, fk, fk, None, None, None, None, None, None, None, None, True, None, None, 0.0, None, None)
        assert out.shape == (2, 10, 4, 64) and lse.shape == (2, 4, 10) and lse.dtype == torch.float32
