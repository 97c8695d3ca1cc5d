"""The FP8 kernel's bf16/fp16-query forms on the CPU (config_fp8 ``q_dtype``; kernels/fwd_fp8.py quantize_q_rows):
the configuration flag and its refusals, the per-row quantization modelled in torch (tests/fp8_emulation.
quantize_rows), and run_fp8_packed launching a bf16/fp16 q end to end against the torch model of the kernel
(tests/test_fp8_split_host.py), checked against the fp32 reference of the unquantized inputs.  The numbers on a
GPU: tests/test_fp8_kvcache_gpu.py, tests/test_fp8_paged_gpu.py."""

import math

import pytest
import torch

from flash_attn_4_sm120 import config_fp8 as C
from flash_attn_4_sm120 import dispatch_fp8 as F8
from flash_attn_4_sm120.fp8_quant import quantize_query
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, quantize_rows, rms
from tests.reference import attention_ref
from tests.test_fp8_split_host import model  # noqa: F401  (the kernel and combine modelled in torch, a fixture)

E4 = torch.float8_e4m3fn
E4_REL = 2.0 ** -4  # half an e4m3 ulp, relative, for normal values


# ---- the configuration flag ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(q_dtype="e5m2", varlen=True), "q_dtype='e5m2'"),
    (dict(q_dtype="bf16"), "q_dtype='bf16' needs varlen=True"),
    (dict(q_dtype="bf16", varlen=True, out_dtype="fp16"), "out_dtype='fp16'"),
    (dict(q_dtype="fp16", varlen=True, out_dtype="bf16"), "out_dtype='bf16'"),
])
def test_q_dtype_refusals_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        C.can_implement(C.Fp8FwdConfig(128, 128, False, **kw))


@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rows", [4, 64])
def test_every_selectable_query_form_is_in_the_worklist(q_dtype, split, paged, rows):
    cfg = C.select_config(128, 128, True, q_dtype, local=True, has_sink=True, varlen=True, pack_gqa=True,
                          split=split, rows=rows, paged=paged, q_dtype=q_dtype)
    assert cfg.q_dtype == q_dtype and cfg in C.all_configs()
    assert f"_q{q_dtype}_" in cfg.name() and cfg.name().endswith("_16x64_w2_s2_kw2" if rows == 4 else "_64x64_w4_s2")
    # the e4m3 twin keeps its name (the committed gate rows stay addressable)
    twin = C.select_config(128, 128, True, q_dtype, local=True, has_sink=True, varlen=True, pack_gqa=True,
                           split=split, rows=rows, paged=paged)
    assert "_q" not in twin.name() and twin.q_dtype == "e4m3" and C.smem_bytes(twin) == C.smem_bytes(cfg)


def test_the_fake_arguments_carry_q_in_its_dtype_and_no_q_descale():
    pytest.importorskip("cutlass")
    import cutlass

    cfg = C.select_config(64, 64, False, "fp16", varlen=True, q_dtype="fp16")
    args = F8.fake_args(cfg)
    assert args[0].element_type == cutlass.Float16 and args[5] is None
    e4 = F8.fake_args(C.select_config(64, 64, False, "fp16", varlen=True))
    assert e4[0].element_type == cutlass.Uint8 and e4[5] is not None


# ---- the per-row quantization (the kernel's rule, in torch) ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_row_gets_its_own_scale(dtype):
    g = torch.Generator().manual_seed(0)
    spread = torch.tensor([1e-3, 1.0, 30.0, 0.0, 200.0]).view(5, 1)
    q = (torch.randn(5, 64, generator=g) * spread).to(dtype)
    q8, dq = quantize_rows(q)
    amax = q.float().abs().amax(-1)
    assert torch.equal(dq, amax * torch.tensor(1 / 448))
    assert (q8[3].float() == 0).all() and dq[3] == 0  # a row of zeros: zeros, descale 0 (scores 0, as unquantized)
    for r in (0, 1, 2, 4):
        assert q8[r].float().abs().max() == 448  # each row's amax lands on e4m3's largest value
        back = q8[r].float() * dq[r]
        normal = q[r].float().abs() >= 2.0 ** -6 * dq[r]
        assert ((back - q[r].float()).abs()[normal] <= E4_REL * 1.001 * q[r].float().abs()[normal]).all()
    q[1, 5] = float("nan")
    q8, dq = quantize_rows(q)
    assert q8[1].float().isnan().sum() == 1 and dq[1].isfinite()  # NaN stays in its element, visible in the output


def test_per_row_scales_are_more_accurate_than_one_per_kv_head_group():
    """FA3's outlier input in bf16 with decode shapes (the accuracy experiment's cell, smaller): the per-row
    query scale's RMS error against the fp32 reference of the unquantized inputs is below the per-(batch, KV
    head) scale's (benchmarks/results/fp8_kvcache_accuracy_cpu.jsonl has the full-size cells)."""
    from flash_attn_4_sm120.fp8_quant import quantize_qkv

    q, k, v = fa3_outlier_inputs(2, 4, 512, 8, 2, 128, seed=3, dtype=torch.bfloat16)
    q[0, 1, 3] *= 40  # one large row: a shared scale crushes its group's other rows
    ref, _ = attention_ref(q, k, v, causal=True)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    qg8, qgd = quantize_query(q, 2)
    per_group = rms(emulate_fp8_attention(qg8, k8, v8, qgd, kd, vd, causal=True), ref)
    qr8, qrd = quantize_rows(q)
    per_row = rms(emulate_fp8_attention(qr8, k8, v8, qrd, kd, vd, causal=True, q_rows=True), ref)
    assert per_row < per_group


# ---- run_fp8_packed with a bf16/fp16 q, against the model of the kernel ---------------------------------------------
def _inputs(lens_q, lens_k, hq, hkv, dtype, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, sum(lens_q), hq, d, generator=g)
         * torch.rand(1, sum(lens_q), hq, 1, generator=g).mul(4).sub(2).exp2()).to(dtype)  # rows 1/4x .. 4x
    q[0, 0, 1] = 0  # a row of zeros
    k = torch.randn(1, sum(lens_k), hkv, d, generator=g).to(E4)
    v = torch.randn(1, sum(lens_k), hkv, d, generator=g).to(E4)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    kd = torch.rand(len(lens_q), hkv, generator=g) + 0.5
    vd = torch.rand(len(lens_q), hkv, generator=g) + 0.5
    return q, k, v, cu(lens_q), cu(lens_k), kd, vd


def _per_sequence(q, k, v, cu_q, cu_k, kd, vd, fn):
    """fn(q_b (1, n, Hq, D), k_b, v_b, kd_b, vd_b) -> out (1, n, Hq, D) per sequence, packed back as rows."""
    outs = []
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        outs.append(fn(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], kd[b:b + 1], vd[b:b + 1])[0].float())
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_bf16_query_is_launched_on_its_q_dtype_form(model, dtype, pack_gqa, splits):
    """The launch's configuration, arguments and per-row descales, end to end: the model of the kernel (fp32 P,
    tests/test_fp8_split_host.py) against the unquantized fp32 reference, within a bar from the emulation of the
    same per-row quantization (fp32 P as well, sequence by sequence); a row's descale applied to another head's
    row lands far outside it."""
    hq, hkv = 8, 2
    q, k, v, cu_q, cu_k, kd, vd = _inputs([1, 3, 2], [70, 200, 5], hq, hkv, dtype)
    out_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    out, lse = F8.run_fp8_packed(q, k, v, cu_q, cu_k, cu_k[1:] - cu_k[:-1], 3, (None, kd, vd), softmax_scale=None,
                                 causal=False, out_name=out_name, out_dtype=dtype, pack_gqa=pack_gqa,
                                 num_splits=splits, max_seqlen_k=200)
    launch = model[0]
    assert launch["cfg"].q_dtype == out_name and launch["cfg"].split == (splits > 1)
    assert launch["cfg"].pack_gqa == pack_gqa and out.dtype == dtype

    def unquantized(qb, kb, vb, kdb, vdb):
        kf = (kb.float() * kdb.view(1, 1, hkv, 1)).to(torch.float64)
        vf = (vb.float() * vdb.view(1, 1, hkv, 1)).to(torch.float64)
        return attention_ref(qb.to(torch.float64), kf, vf)[0]

    def emulated(qb, kb, vb, kdb, vdb):
        q8, qd = quantize_rows(qb)
        return emulate_fp8_attention(q8, kb, vb, qd, kdb, vdb, q_rows=True, quantize_p=False, out_dtype=dtype)

    def rolled(qb, kb, vb, kdb, vdb):  # each row scored with the next head's descale
        q8, qd = quantize_rows(qb)
        return emulate_fp8_attention(q8, kb, vb, qd.roll(1, -1), kdb, vdb, q_rows=True, quantize_p=False,
                                     out_dtype=dtype)

    ref = _per_sequence(q, k, v, cu_q, cu_k, kd, vd, unquantized)
    bar = 2 * rms(_per_sequence(q, k, v, cu_q, cu_k, kd, vd, emulated), ref) + 2e-3
    err = rms(out[0], ref)
    assert 0 < err <= bar  # not exact: q really went through e4m3
    assert rms(_per_sequence(q, k, v, cu_q, cu_k, kd, vd, rolled), ref) > 5 * bar  # the bar sees a misplaced scale
    # the zero row: scores all 0 -> the mean of its keys' values, LSE = log(keys)
    g0 = 1 // (hq // hkv)
    torch.testing.assert_close(out[0, 0, 1].float(), (v[0, :70, g0].float() * vd[0, g0]).mean(0), rtol=0, atol=1e-2)
    torch.testing.assert_close(lse[0, 1, 0], torch.tensor(math.log(70.0)), rtol=0, atol=1e-4)
