"""Backward preprocess kernel on a GPU: D = rowsum(dO * O) - dLSE against the torch expression in fp64.

Bar: |ours - ref| <= 1e-5 * (sum_j |dO_j O_j| + |dLSE|) per row (+ 1e-30): the fp32 rounding of any summation
order of at most 512 products is below 512 * 2**-24 (about 3e-5) of that scale, in practice a few 1e-7; a wrong
element, a missed vector or row, a wrong layout or dLSE sign gives errors of the order of the scale itself.
"""

import pytest
import torch

from reference import dpsum_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")
from flash_attn_4_sm120 import dispatch_bwd  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _check(dout, out, dlse, varlen):
    got = dispatch_bwd.bwd_dpsum(dout, out, dlse, varlen)
    torch.cuda.synchronize()
    ref, mag = dpsum_ref(dout, out, dlse, varlen, dtype=torch.float64)
    assert got.dtype == torch.float32 and got.shape == ref.shape and got.is_contiguous()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), "non-finite values in other rows than the reference's"
    inf = ~fin & ~ref.isnan()
    assert torch.equal(got[~fin].isnan(), ref[~fin].isnan()) and torch.equal(got[inf].double(), ref[inf])
    err = (got.double() - ref).abs()[fin]
    bound = 1e-5 * mag[fin] + 1e-30
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"error {err[worst].item():.3e} > bound {bound[worst].item():.3e}"
    return got


def _rand(shape, dtype, gen, wide=0):
    """Random (…, D) tensor; ``wide`` > 0 makes it a view of a (…, D + wide) buffer (rows strided, last dim
    contiguous)."""
    full = torch.randn(*shape[:-1], shape[-1] + wide, device="cuda", generator=gen).to(dtype)
    return full[..., :shape[-1]]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dv", [8, 64, 96, 128, 256])
@pytest.mark.parametrize("seqlen", [1, 17, 113])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_dense(dtype, dv, seqlen, with_dlse):
    gen = torch.Generator(device="cuda").manual_seed(dv * 1000 + seqlen)
    b, h = 3, 5
    out = _rand((b, seqlen, h, dv), DTYPES[dtype], gen)
    dout = _rand((b, seqlen, h, dv), DTYPES[dtype], gen)
    dlse = torch.randn(b, h, seqlen, device="cuda", generator=gen) if with_dlse else None
    _check(dout, out, dlse, False)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dv", [8, 64, 96, 128, 256])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_varlen_with_an_empty_sequence(dtype, dv, with_dlse):
    gen = torch.Generator(device="cuda").manual_seed(dv)
    lens = [17, 0, 1, 113]  # cu_seqlens does not enter the kernel: every row of the (total, H, D) tensor is computed
    total, h = sum(lens), 4
    out = _rand((total, h, dv), DTYPES[dtype], gen)
    dout = _rand((total, h, dv), DTYPES[dtype], gen)
    dlse = torch.randn(h, total, device="cuda", generator=gen) if with_dlse else None
    _check(dout, out, dlse, True)


@pytest.mark.parametrize("dv", [64, 96, 128])
@pytest.mark.parametrize("varlen", [False, True])
def test_strided_inputs_and_expanded_dlse(dv, varlen):
    gen = torch.Generator(device="cuda").manual_seed(7)
    shape = (113, 6, dv) if varlen else (2, 113, 6, dv)
    out = _rand(shape, torch.bfloat16, gen, wide=16)  # rows 2 * (dv + 16) bytes apart
    # dout in (B, H, S, D) memory viewed as (B, S, H, D): the sequence is not the outer stride
    lead = shape[:-3] if not varlen else ()
    dout = torch.randn(*lead, shape[-2], shape[-3], dv, device="cuda", generator=gen).bfloat16().transpose(-2, -3)
    assert dout.shape == out.shape and not dout.is_contiguous() and dout.stride(-1) == 1
    lse_shape = (6, 113) if varlen else (2, 6, 113)
    _check(dout, out, torch.full((), 0.25, device="cuda").expand(lse_shape), varlen)  # stride 0: d(lse.sum())/4
    _check(dout, out, torch.randn(lse_shape[::-1], device="cuda", generator=gen).permute(
        *range(len(lse_shape) - 1, -1, -1)), varlen)  # transposed dlse


@pytest.mark.parametrize("dv", [96, 256])
def test_non_finite_values_reach_their_row_only(dv):
    gen = torch.Generator(device="cuda").manual_seed(3)
    out = _rand((2, 9, 3, dv), torch.float16, gen)
    dout = _rand((2, 9, 3, dv), torch.float16, gen)
    out[0, 4, 1, dv - 1] = float("inf")  # the last vector: on dv=96 the idle lanes reload it and must drop it
    dout[0, 4, 1, dv - 1] = 1.0
    dout[1, 2, 0, 3] = float("nan")
    got = _check(dout, out, None, False)
    assert got[0, 1, 4] == float("inf") and got[1, 0, 2].isnan()
    assert torch.isfinite(got).sum() == got.numel() - 2


@pytest.mark.parametrize("max_rows", [7, 100])
def test_chunked_launches(monkeypatch, max_rows):
    monkeypatch.setattr(dispatch_bwd, "PRE_MAX_ROWS", max_rows)  # as if B * H * S overflowed int32
    gen = torch.Generator(device="cuda").manual_seed(max_rows)
    out, dout = (_rand((3, 41, 4, 64), torch.bfloat16, gen) for _ in range(2))
    _check(dout, out, torch.randn(3, 4, 41, device="cuda", generator=gen), False)
    out, dout = (_rand((41, 4, 128), torch.float16, gen) for _ in range(2))
    _check(dout, out, None, True)


@pytest.mark.parametrize("shape", [(0, 5, 2, 64), (2, 0, 2, 64), (0, 2, 64)])
def test_empty(shape):
    t = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    assert dispatch_bwd.bwd_dpsum(t, t, None, len(shape) == 3).numel() == 0


def test_large_rows_throughput_shape():
    """The llama3-8b backward shape (B=4, S=4096, H=32, D=128): many CTAs, one launch."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    out, dout = (_rand((4, 4096, 32, 128), torch.bfloat16, gen) for _ in range(2))
    _check(dout, out, torch.randn(4, 32, 4096, device="cuda", generator=gen), False)


def test_backward_matches_with_dlse():
    """End to end through autograd, the gradient flowing through the output and the returned LSE: within twice
    PyTorch-in-bf16's error of the fp32 reference (plus 1e-3)."""
    from reference import attention_ref

    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 65, 4, 96, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(3))
    g = torch.randn(2, 65, 4, 96, device="cuda", generator=gen).bfloat16()
    g_lse = torch.randn(2, 4, 65, device="cuda", generator=gen)

    def grads(fn, inputs):
        out, lse = fn(*inputs)
        return torch.autograd.grad((out.float() * g.float()).sum() + (lse.float() * g_lse).sum(), inputs)

    ours = grads(lambda *t: fa.flash_attn_func(*t, causal=True, return_lse=True), (q, k, v))
    ref = grads(lambda *t: attention_ref(*t, causal=True), tuple(t.detach().float().requires_grad_()
                                                                   for t in (q, k, v)))
    pt = grads(lambda *t: attention_ref(*t, causal=True, upcast=False), tuple(t.detach().requires_grad_()
                                                                              for t in (q, k, v)))
    for name, o, r, p in zip(("dq", "dk", "dv"), ours, ref, pt):
        err, err_pt = (o.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
        assert err <= 2 * err_pt + 1e-3, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + 1e-3"
