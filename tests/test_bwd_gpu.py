"""Backward correctness on a GPU against fp32 autograd through the reference.

Bar (per gradient): max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol.
"""

import pytest
import torch

from reference import attention_ref, varlen_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")


def _rand(*shape, dtype, gen, grad=True):
    t = torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    return t.requires_grad_(grad)


def _tol_check(name, ours, ref, pt):
    assert ours is not None and torch.isfinite(ours).all(), f"{name}: non-finite gradient"
    atol = 2 * (ref.float() + 0.3 - 0.3 - ref.float()).abs().max().item() + 1e-4
    err = (ours.float() - ref.float()).abs().max().item()
    err_pt = (pt.float() - ref.float()).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {atol:.1e}"


def _grads(fn, inputs, g):
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def check(q, k, v, sink=None, **kw):
    inputs = (q, k, v) + ((sink,) if sink is not None else ())
    out, lse = fa.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, inputs, g)
    ref_in = tuple(t.detach().float().requires_grad_() for t in inputs)
    pt_in = tuple(t.detach().clone().requires_grad_() for t in inputs)

    ref_kw = {("window" if key == "window_size" else key): val for key, val in kw.items() if key != "deterministic"}

    def ref_fn(*ts, upcast):
        return attention_ref(ts[0], ts[1], ts[2], sink=ts[3] if len(ts) > 3 else None, upcast=upcast, **ref_kw)[0]

    ref = _grads(lambda *ts: ref_fn(*ts, upcast=True), ref_in, g.float())
    pt = _grads(lambda *ts: ref_fn(*ts, upcast=False), pt_in, g)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsink"), ours, ref, pt):
        _tol_check(name, a, b, c)


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (_rand(b, sq, hq, d, dtype=dtype, gen=g), _rand(b, sk, hkv, d, dtype=dtype, gen=g),
            _rand(b, sk, hkv, dv, dtype=dtype, gen=g))


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (96, 96), (192, 128), (256, 256), (32, 32), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (113, 113), (255, 1023)])
def test_bwd_dense(d, dv, causal, sq, sk):
    q, k, v = _inputs(2, sq, sk, 4, 2, d, dv, seed=1)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_gqa(hq, hkv, causal):
    q, k, v = _inputs(2, 333, 333, hq, hkv, 128, 128, seed=2)
    check(q, k, v, causal=causal)


def test_bwd_fp16():
    q, k, v = _inputs(1, 200, 300, 4, 4, 128, 128, dtype=torch.float16, seed=3)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("window", [(64, 0), (32, 16), (None, 48)])
def test_bwd_window(window):
    q, k, v = _inputs(2, 500, 700, 4, 2, 64, 64, seed=4)
    check(q, k, v, window_size=window)


@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_bwd_softcap_sink(use_sink, softcap):
    q, k, v = _inputs(2, 200, 200, 4, 2, 128, 128, seed=5)
    with torch.no_grad():
        q.mul_(3)
    gen = torch.Generator(device="cuda").manual_seed(55)
    sink = (torch.randn(4, device="cuda", generator=gen) * 2).requires_grad_() if use_sink else None
    check(q, k, v, sink=sink, causal=True, softcap=softcap)


def test_bwd_through_lse():
    q, k, v = _inputs(1, 100, 150, 2, 2, 64, 64, seed=6)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    gl = torch.randn_like(lse)
    ours = torch.autograd.grad((lse * gl).sum(), (q, k))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    _, lse_ref = attention_ref(qf, kf, vf, causal=True)
    ref = torch.autograd.grad((lse_ref * gl).sum(), (qf, kf))
    for a, b in zip(ours, ref):
        assert (a.float() - b).abs().max().item() < 2e-2


def test_bwd_varlen():
    lens_q, lens_k = [17, 0, 113, 300], [33, 5, 113, 400]
    g = torch.Generator(device="cuda").manual_seed(7)
    q = _rand(sum(lens_q), 8, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(sum(lens_k), 2, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(sum(lens_k), 2, 128, dtype=torch.bfloat16, gen=g)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out, _ = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    gout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), gout)

    def ref_grads(upcast):
        ins = tuple((t.detach().float() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v))
        o, _ = varlen_ref(*ins, cu_q, cu_k, upcast=upcast, causal=True)
        o = torch.nan_to_num(o)
        return torch.autograd.grad(o, ins, gout.float() if upcast else gout)

    ref, pt = ref_grads(True), ref_grads(False)
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, ref, pt):
        _tol_check(name, a, b, c)


def test_bwd_rows_without_keys_are_zero():
    q, k, v = _inputs(1, 300, 100, 2, 2, 64, 64, seed=8)
    out, _ = fa.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.all(dq[0, :200] == 0)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_deterministic_matches_reference(d, dv, causal):
    q, k, v = _inputs(2, 300, 333, 8, 2, d, dv, seed=9)
    check(q, k, v, causal=causal, deterministic=True)


def test_bwd_deterministic_is_bitwise_reproducible():
    q, k, v = _inputs(2, 777, 777, 8, 2, 128, 128, seed=10)
    sink = torch.randn(8, device="cuda").requires_grad_()
    g = torch.randn(2, 777, 8, 128, device="cuda", dtype=torch.bfloat16)

    def run():
        out, _ = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)
        return torch.autograd.grad(out, (q, k, v, sink), g)

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bwd_varlen_is_bitwise_reproducible():
    """Two identical varlen GQA backward calls give bitwise-equal gradients.  (``deterministic=True`` is accepted
    and not passed further: the backward has no atomics, so there is no second path to compare it with; a test
    that compared the flag's call with the default one compared the same kernels with themselves.)"""
    lens_q, lens_k = [17, 0, 300], [33, 5, 400]
    g = torch.Generator(device="cuda").manual_seed(11)
    q = _rand(sum(lens_q), 4, 64, dtype=torch.bfloat16, gen=g)
    k = _rand(sum(lens_k), 2, 64, dtype=torch.bfloat16, gen=g)
    v = _rand(sum(lens_k), 2, 64, dtype=torch.bfloat16, gen=g)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), causal=True)
    gout = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)

    def run():
        out, _ = fa.flash_attn_varlen_func(q, k, v, deterministic=True, **kw)
        return torch.autograd.grad(out, (q, k, v), gout)

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b)
