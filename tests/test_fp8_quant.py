"""The FP8 quantize helper (fp8_quant.py) and the emulated FP8 forward on the CPU."""

import math

import pytest
import torch

from flash_attn_4_sm120.fp8_quant import E4M3_MAX, dequantize, hadamard, quantize_qkv
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, rms
from tests.reference import attention_ref

E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa: the largest relative rounding error of a normal value


@pytest.mark.parametrize("n", [1, 2, 32, 64, 96, 128, 192, 256])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n, dtype=torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h.T)
    p = n & -n  # entries are +-1/sqrt(block) inside the diagonal blocks, 0 outside
    assert torch.allclose(h.abs()[h != 0], torch.full((1,), p ** -0.5, dtype=torch.float64))
    assert int((h != 0).sum()) == p * n


def test_hadamard_matches_sylvester_at_4():
    h = hadamard(4) * 2
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32)
    torch.testing.assert_close(h, expected)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "64"])
def test_hadamard_rejects_bad_size(bad):
    with pytest.raises(ValueError, match="positive int"):
        hadamard(bad)


def test_rotation_leaves_scores_unchanged():
    q, k, _ = fa3_outlier_inputs(2, 37, 53, 4, 2, 128, seed=1, dtype=torch.float64)
    h = hadamard(128, dtype=torch.float64)
    s = torch.einsum("bqhd,bkhd->bhqk", q[:, :, :2], k)
    s_rot = torch.einsum("bqhd,bkhd->bhqk", q[:, :, :2] @ h, k @ h)
    torch.testing.assert_close(s_rot, s, rtol=0, atol=1e-10)


def test_rotation_shrinks_the_range_an_outlier_forces():
    x = torch.randn(1, 64, 1, 128)
    x[0, 3, 0, 5] = 60.0
    amax_plain = x.abs().amax()
    amax_rot = (x @ hadamard(128)).abs().amax()
    assert amax_rot < amax_plain / 4  # the outlier is spread over 128 coordinates: 60 / sqrt(128) ~ 5.3


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("rotate", [False, True])
def test_round_trip_error_is_within_half_an_e4m3_ulp(granularity, rotate):
    q, k, v = fa3_outlier_inputs(2, 67, 45, 6, 2, 64, seed=3)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, rotate=rotate, granularity=granularity, block_size=16)
    for x8 in (q8, k8, v8):
        assert x8.dtype == torch.float8_e4m3fn and x8.is_contiguous()
    assert q8.shape == q.shape and k8.shape == k.shape and v8.shape == v.shape
    assert vd.shape == (2, 2) and vd.dtype == torch.float32
    if granularity == "block":
        assert qd.shape == (2, 2, math.ceil(67 / 16)) and kd.shape == (2, 2, math.ceil(45 / 16))
    else:
        assert qd.shape == kd.shape == (2, 2) and qd.dtype == kd.dtype == torch.float32
    h = hadamard(64) if rotate else torch.eye(64)
    for x, x8, dsc in ((q @ h, q8, qd), (k @ h, k8, kd), (v, v8, vd)):
        back = dequantize(x8, dsc, block_size=16)
        assert (x8.float().abs() <= E4M3_MAX).all()
        # normal range: relative error <= 2^-4; below it (|x| < 2^-6 * descale) an absolute 2^-10 * descale
        dmax = dsc.max()
        tol = E4M3_REL * x.abs() + 2.0 ** -10 * dmax
        assert ((back - x).abs() <= tol).all(), float(((back - x).abs() - tol).max())


def test_head_granularity_scales_each_group_by_its_own_max():
    q, k, v = fa3_outlier_inputs(1, 32, 32, 4, 2, 64, seed=0)
    k[:, :, 1] *= 100.0  # group 1 is 100x larger: its descale, not group 0's, moves
    _, k8, _, _, kd, _ = quantize_qkv(q, k, v)
    torch.testing.assert_close(kd[0], k[0].abs().amax(dim=(0, 2)) / E4M3_MAX)
    assert k8.float().abs().amax() == E4M3_MAX  # each group's max maps to the top of the range


def test_zero_group_gets_descale_one_and_nan_propagates():
    q, k, v = fa3_outlier_inputs(1, 8, 8, 2, 2, 64, seed=0)
    v[:, :, 0] = 0.0
    k[0, 3, 1, 7] = float("nan")
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    assert vd[0, 0] == 1.0 and (v8[:, :, 0].float() == 0).all()
    assert torch.isnan(kd[0, 1]) and not torch.isnan(kd[0, 0])


def test_quantize_is_capturable_shape_only_code():
    # no .item()/.tolist()/nonzero on the inputs: a meta-device run would raise on any data-dependent host read
    q, k, v = (torch.empty(2, 16, 4, 64, device="meta") for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    out = quantize_qkv(q, k, v, rotate=True)
    assert out[3].shape == (2, 2) and out[0].dtype == torch.float8_e4m3fn
    out = quantize_qkv(q, k, v, rotate=True, granularity="block", block_size=8)
    assert out[3].shape == (2, 2, 2)


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 3, 64)), "4-D"),
    (dict(q=torch.zeros(1, 8, 2, 64, dtype=torch.int8)), "float16, bfloat16 or float32"),
    (dict(k=torch.zeros(1, 8, 3, 64), v=torch.zeros(1, 8, 3, 64)), "multiple"),
    (dict(k=torch.zeros(1, 8, 2, 32)), "head_dim"),
    (dict(v=torch.zeros(1, 9, 2, 64)), "do not agree"),
    (dict(rotate=1), "rotate"),
    (dict(granularity="row"), "granularity"),
    (dict(granularity="block", block_size=0), "block_size"),
    (dict(q="q"), "torch.Tensor"),
])
def test_bad_input_raises_naming_it(bad, match):
    args = dict(q=torch.zeros(1, 8, 4, 64), k=torch.zeros(1, 8, 2, 64), v=torch.zeros(1, 8, 2, 64))
    kw = {key: bad.pop(key) for key in list(bad) if key in ("rotate", "granularity", "block_size")}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quantize_qkv(args["q"], args["k"], args["v"], **kw)


def test_emulation_without_quantization_error_matches_the_reference():
    # e4m3-exact inputs with unit descales and P kept in fp32: the emulation is exact attention
    q, k, v = fa3_outlier_inputs(1, 70, 150, 4, 2, 64, seed=2)
    q8, k8, v8 = (x.clamp(-448, 448).to(torch.float8_e4m3fn) for x in (q, k, v))
    ones = torch.ones(1, 2)
    sink = torch.tensor([0.5, -1.0, 30.0, float("-inf")])
    for causal, window, with_sink in ((False, (None, None), False), (True, (None, None), False),
                                      (False, (20, 7), False), (True, (33, None), True), (False, (None, None), True)):
        ref, _ = attention_ref(q8.float(), k8.float(), v8.float(), causal=causal, window=window,
                               sink=sink if with_sink else None)
        out = emulate_fp8_attention(q8, k8, v8, ones, ones, ones, causal=causal, quantize_p=False,
                                    out_dtype=torch.float32, window=window, sink=sink if with_sink else None)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_emulated_fp8_error_is_in_the_measured_range():
    """A smaller cell of benchmarks/results/fp8_accuracy_cpu.jsonl: rotation helps, P's rounding costs little."""
    q, k, v = fa3_outlier_inputs(1, 512, 512, 2, 1, 128, seed=0)
    ref, _ = attention_ref(q, k, v, causal=True)
    errs = {}
    for name, rot, qp in (("plain", False, True), ("rot", True, True), ("rot_p32", True, False)):
        out = emulate_fp8_attention(*quantize_qkv(q, k, v, rotate=rot), causal=True, quantize_p=qp)
        errs[name] = rms(out, ref)
    assert errs["rot"] < errs["plain"]
    assert errs["rot"] < 1.5e-2 and errs["plain"] < 3e-2, errs
    assert errs["rot_p32"] <= errs["rot"] * 1.1


def test_emulation_slack_covers_a_p_at_an_e4m3_rounding_midpoint():
    """A row whose window holds two keys, one of whose 16·P lands on 8.5 (the midpoint of e4m3's 8 and 9) up to a
    few fp32 ulps: the GPU may round it either way, and the slack is exactly the move of that one step."""
    d = 64
    q8, k8, v8 = (torch.zeros(1, 2, 1, d) for _ in range(3))
    q8[0, :, 0, 0] = 1.0
    k8[0, 0, 0, 0] = 1.0  # key 0 scores 1 * scale, key 1 scores 0
    v8[0, 1, 0, :] = 1.0  # v0 = 0, v1 = 1: out = P8(key 1) / (16 + 16 P(key 1)) in every column
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q8, k8, v8))
    ones = torch.ones(1, 1)
    scale = math.log2(16 / 8.5) / math.log2(math.e)  # 16·exp2(−scale·log2e) = 8.5
    out, slack = emulate_fp8_attention(q8, k8, v8, ones, ones, ones, softmax_scale=scale, out_dtype=torch.float32,
                                       return_slack=True)
    row_sum = 16 + 8.5  # in 16ths, up to the fp32 ulps that decide the rounding
    assert set(torch.round(out[0, 1, 0] * row_sum).tolist()) <= {8.0, 9.0}
    torch.testing.assert_close(slack[0, 1, 0], torch.full((d,), 1 / row_sum), rtol=1e-5, atol=0)
    # row 0 sees the same two keys (no mask), the same tie; a scale off the midpoint leaves no slack at all
    _, slack = emulate_fp8_attention(q8, k8, v8, ones, ones, ones, softmax_scale=scale * 1.01,
                                     out_dtype=torch.float32, return_slack=True)
    assert not slack.any()
