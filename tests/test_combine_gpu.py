"""Split-KV combine kernel on a GPU against the fp64 reference (tests/reference.py: combine_ref): odd shapes,
1..256 splits, head dims 32..512, empty splits (LSE -inf) and rows whose splits are all empty, NaN propagation,
varlen layout, strided LSE views, ``out=``, and partials of a real attention split."""

import math

import pytest
import torch

from reference import attention_ref, combine_ref, split_partials

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _partials(splits, lead, d, seed, empty_frac=0.3, dtype=torch.float32, lse_transposed=True):
    """out_partial (splits, *lead, d) and lse_partial (splits, *lead); a fraction of (split, row) pairs empty
    (lse -inf, out NaN: must never be read), plus whole rows with every split empty."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    op = torch.randn(splits, *lead, d, device="cuda", generator=g)
    if lse_transposed and len(lead) == 3:  # flash-attn-4's forward layout: (splits, B, H, S) viewed as (.., S, H)
        b, s, h = lead
        lp = (torch.randn(splits, b, h, s, device="cuda", generator=g) * 4).transpose(2, 3)
    else:
        lp = torch.randn(splits, *lead, device="cuda", generator=g) * 4
    empty = torch.rand(splits, *lead, device="cuda", generator=g) < empty_frac
    flat_rows = empty.view(splits, -1)
    flat_rows[:, :: 7] = True  # every 7th row: all splits empty
    lp = lp.masked_fill(empty, -math.inf)
    op = op.masked_fill(empty[..., None], float("nan"))
    return op.to(dtype), lp


def _check(out, lse, op, lp, out_dtype):
    ref, lse_ref = combine_ref(op, lp)
    assert out.dtype == out_dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN leaked from an empty split"
    atol, rtol = TOL[out_dtype]
    torch.testing.assert_close(out.double(), ref.to(out_dtype).double(), atol=atol, rtol=rtol)
    if lse is not None:
        assert lse.shape == lse_ref.shape and lse.dtype == torch.float32
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "LSE is -inf exactly where the reference is"
        torch.testing.assert_close(lse.double(), lse_ref, atol=1e-4, rtol=1e-5)
        all_empty = torch.isinf(lse_ref)
        assert all_empty.any() and (out[all_empty] == 0).all()


@pytest.mark.parametrize("splits", [1, 2, 7, 64, 128, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,s,h", [(1, 1, 32), (3, 17, 5), (2, 113, 7)])
def test_combine_matches_reference(splits, d, b, s, h):
    op, lp = _partials(splits, (b, s, h), d, seed=splits * 1000 + d + s)
    out, lse = fa.flash_attn_combine(op, lp)
    _check(out, lse, op, lp, torch.float32)
    assert lse.stride(1) == 1, "lse is (B, S, H) with the sequence contiguous, as flash-attn-4 returns it"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [32, 96, 192, 512, 8, 40])
def test_combine_dtypes_and_head_dims(out_dtype, d):
    op, lp = _partials(7, (2, 33, 3), d, seed=d)
    out, lse = fa.flash_attn_combine(op, lp, out_dtype=out_dtype)
    _check(out, lse, op, lp, out_dtype)


@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float16])
def test_combine_half_precision_partials(partial_dtype):
    op, lp = _partials(5, (2, 9, 4), 128, seed=3, dtype=partial_dtype)
    out, lse = fa.flash_attn_combine(op, lp)
    _check(out, lse, op, lp, partial_dtype)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_combine_varlen_layout(splits):
    total_q, h, d = 301, 6, 128
    op, lp = _partials(splits, (total_q, h), d, seed=splits, lse_transposed=False)
    lp = lp.transpose(1, 2).contiguous().transpose(1, 2)  # (splits, H, total_q) storage, as the forward writes it
    out, lse = fa.flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    assert out.shape == (total_q, h, d) and lse.shape == (total_q, h) and lse.stride(0) == 1
    _check(out, lse, op, lp, torch.bfloat16)


def test_combine_into_out_and_without_lse():
    op, lp = _partials(9, (2, 40, 8), 64, seed=11)
    out = torch.full((2, 40, 8, 64), 7.0, dtype=torch.bfloat16, device="cuda")
    res, lse = fa.flash_attn_combine(op, lp, out=out, return_lse=False)
    assert res is out and lse is None
    _check(out, None, op, lp, torch.bfloat16)
    # a strided out (rows of a wider buffer) is written in place, the padding untouched
    wide = torch.full((2, 40, 8, 72), 5.0, device="cuda")
    fa.flash_attn_combine(op, lp, out=wide[..., :64])
    _check(wide[..., :64], None, op, lp, torch.float32)
    assert (wide[..., 64:] == 5.0).all()


def test_combine_nan_is_not_hidden():
    g = torch.Generator(device="cuda").manual_seed(5)
    op = torch.randn(4, 1, 6, 2, 64, device="cuda", generator=g)
    lp = torch.randn(4, 1, 6, 2, device="cuda", generator=g)  # no empty split anywhere
    lp[2, 0, 1, 0] = float("nan")  # a NaN LSE: row (1, 0) is NaN in out and lse
    op[1, 0, 3, 1, 5] = float("nan")  # a NaN in a non-empty split's output reaches that element only
    out, lse = fa.flash_attn_combine(op, lp)
    assert torch.isnan(lse[0, 1, 0]) and torch.isnan(out[0, 1, 0]).all()
    assert torch.isnan(out[0, 3, 1, 5]) and torch.isfinite(lse[0, 3, 1])
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[0, 1, 0] = False
    mask[0, 3, 1, 5] = False
    assert torch.isfinite(out[mask]).all()
    lse_mask = torch.ones_like(lse, dtype=torch.bool)
    lse_mask[0, 1, 0] = False
    assert torch.isfinite(lse[lse_mask]).all()


@pytest.mark.parametrize("splits", [2, 7, 64])
def test_combine_of_a_real_attention_split(splits):
    g = torch.Generator(device="cuda").manual_seed(splits)
    q = torch.randn(2, 3, 8, 128, device="cuda", generator=g)
    k = torch.randn(2, 1000, 2, 128, device="cuda", generator=g)
    v = torch.randn(2, 1000, 2, 128, device="cuda", generator=g)
    op, lp = split_partials(q, k, v, splits)
    out, lse = fa.flash_attn_combine(op, lp, out_dtype=torch.float32)
    ref, lse_ref = attention_ref(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref.transpose(1, 2), atol=1e-4, rtol=1e-5)


def test_combine_empty_inputs_and_no_sync():
    op = torch.zeros(3, 0, 5, 4, 64, device="cuda")
    out, lse = fa.flash_attn_combine(op, torch.zeros(3, 0, 5, 4, device="cuda"))
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 5, 4)
    op, lp = _partials(7, (2, 5, 4), 64, seed=1)
    fa.flash_attn_combine(op, lp)  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fa.flash_attn_combine(op, lp)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_combine_cuda_graph_replay():
    op, lp = _partials(7, (2, 5, 4), 128, seed=2)
    out = torch.empty(2, 5, 4, 128, device="cuda")
    fa.flash_attn_combine(op, lp, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = fa.flash_attn_combine(op, lp, out=out)
    op2, lp2 = _partials(7, (2, 5, 4), 128, seed=9)
    op.copy_(op2)
    lp.copy_(lp2)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, lse, op2, lp2, torch.float32)
