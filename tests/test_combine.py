"""Split-KV combine, CPU side: the reference's math, the host checks (every reject names the value), the kernel's
argument record and its sm_120a compile."""

import math

import pytest
import torch

from flash_attn_4_sm120 import arguments, config, config_combine, interface
from flash_attn_4_sm120.combine import check_combine
from reference import attention_ref, combine_ref, split_partials


@pytest.mark.parametrize("num_splits", [1, 2, 7, 13])
def test_reference_combine_equals_full_attention(num_splits):
    g = torch.Generator().manual_seed(num_splits)
    q, k, v = (torch.randn(2, 5, 3, 16, generator=g) for _ in range(3))
    k, v = torch.randn(2, 11, 3, 16, generator=g), torch.randn(2, 11, 3, 16, generator=g)
    op, lp = split_partials(q, k, v, num_splits)  # 13 splits of 11 keys: two empty chunks
    out, lse = combine_ref(op, lp)
    ref, lse_ref = attention_ref(q, k, v)
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.float(), lse_ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_reference_combine_empty_and_nan_rules():
    op = torch.randn(3, 1, 2, 1, 8, dtype=torch.float64)
    lp = torch.tensor([0.5, -math.inf, 1.0], dtype=torch.float64).view(3, 1, 1, 1).repeat(1, 1, 2, 1)
    lp[:, 0, 1, 0] = -math.inf  # row 1: every split empty
    op[1] = float("nan")  # an empty split's garbage is never read
    out, lse = combine_ref(op, lp)
    assert torch.isfinite(out[0, 0]).all() and torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert lse[0, 1, 0] == -math.inf
    w0 = math.exp(0.5 - lse[0, 0, 0].item())
    w2 = math.exp(1.0 - lse[0, 0, 0].item())
    torch.testing.assert_close(out[0, 0, 0], w0 * op[0, 0, 0, 0] + w2 * op[2, 0, 0, 0])
    lp[0, 0, 0, 0] = float("nan")
    out, lse = combine_ref(op, lp)
    assert torch.isnan(lse[0, 0, 0]) and torch.isnan(out[0, 0, 0]).all()


def _ok(splits=3, b=2, s=5, h=4, d=64, dtype=torch.float32):
    return torch.zeros(splits, b, s, h, d, dtype=dtype), torch.zeros(splits, b, s, h)


REJECTS = {
    "not a tensor": (lambda: ([1.0], _ok()[1]), {}, "out_partial must be a torch.Tensor"),
    "lse not a tensor": (lambda: (_ok()[0], None), {}, "lse_partial must be a torch.Tensor"),
    "rank 3": (lambda: (torch.zeros(3, 4, 64), torch.zeros(3, 4)), {}, "got shape (3, 4, 64)"),
    "int partial": (lambda: (_ok()[0].int(), _ok()[1]), {}, "torch.int32"),
    "fp64 partial": (lambda: (_ok()[0].double(), _ok()[1]), {}, "torch.float64"),
    "bf16 lse": (lambda: (_ok()[0], _ok()[1].bfloat16()), {}, "lse_partial must have dtype torch.float32"),
    "lse shape": (lambda: (_ok()[0], torch.zeros(3, 2, 4, 5)), {}, "lse_partial must have shape (3, 2, 5, 4)"),
    "zero splits": (lambda: _ok(splits=0), {}, "num_splits (out_partial.shape[0]) = 0"),
    "257 splits": (lambda: _ok(splits=257, b=1, s=1, h=1, d=8), {}, "= 257 must be in [1, 256]"),
    "head_dim 60": (lambda: _ok(d=60), {}, "head_dim=60"),
    "head_dim 520": (lambda: _ok(d=520, splits=1, b=1, s=1, h=1), {}, "head_dim=520"),
    "strided last dim": (lambda: (torch.zeros(3, 2, 5, 4, 128)[..., ::2], _ok()[1]), {}, "stride(-1) = 2"),
    "misaligned rows": (lambda: (torch.zeros(3, 2, 5, 4, 66)[..., :64], _ok()[1]), {}, "16-byte aligned"),
    "misaligned pointer": (lambda: (torch.zeros(3 * 2 * 5 * 4 * 64 + 1)[1:].view(3, 2, 5, 4, 64), _ok()[1]), {},
                           "data_ptr % 16 = 4"),
    "out_dtype int": (lambda: _ok(), {"out_dtype": torch.int8}, "out_dtype=torch.int8"),
    "out shape": (lambda: _ok(), lambda: {"out": torch.zeros(2, 5, 4, 32)}, "out must have shape (2, 5, 4, 64)"),
    "out dtype": (lambda: _ok(), lambda: {"out": torch.zeros(2, 5, 4, 64, dtype=torch.float64)}, "torch.float64"),
    "out vs out_dtype": (lambda: _ok(), lambda: {"out": torch.zeros(2, 5, 4, 64), "out_dtype": torch.bfloat16},
                         "make them agree"),
    "out not a tensor": (lambda: _ok(), {"out": 3}, "out must be a torch.Tensor"),
    "out strided": (lambda: _ok(), lambda: {"out": torch.zeros(2, 5, 4, 128)[..., ::2]}, "out must be contiguous"),
    "return_lse": (lambda: _ok(), {"return_lse": 1}, "return_lse must be True or False"),
    "requires grad": (lambda: (_ok()[0].requires_grad_(), _ok()[1]), {}, "inference-only"),
    "cpu tensors": (lambda: _ok(), {}, "needs CUDA tensors"),
}


@pytest.mark.parametrize("name", list(REJECTS))
def test_combine_rejects(name):
    make, kwargs, needle = REJECTS[name]
    op, lp = make()
    kwargs = kwargs() if callable(kwargs) else kwargs
    with pytest.raises(ValueError) as info:
        interface.flash_attn_combine(op, lp, **kwargs)
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["cu_seqlens", "seqused", "varlen_batch_idx"])
def test_combine_unsupported_keywords(name):
    op, lp = _ok()
    with pytest.raises(NotImplementedError, match=name):
        interface.flash_attn_combine(op, lp, **{name: torch.zeros(3, dtype=torch.int32)})


def test_combine_positional_order_matches_upstream():
    import inspect

    params = list(inspect.signature(interface.flash_attn_combine).parameters)
    assert params == ["out_partial", "lse_partial", "out", "out_dtype", "cu_seqlens", "seqused", "varlen_batch_idx",
                      "return_lse"]


def test_combine_check_picks_the_output_dtype():
    op, lp = _ok(dtype=torch.bfloat16)
    op, lp = op.cuda() if torch.cuda.is_available() else op, lp
    if not op.is_cuda:
        with pytest.raises(ValueError, match="CUDA"):
            check_combine(op, lp, None, None, True)
        return
    lp = lp.cuda()
    assert check_combine(op, lp, None, None, True) == torch.bfloat16
    assert check_combine(op, lp, None, torch.float32, True) == torch.float32


def test_combine_threads_per_row():
    tprs = [config_combine.combine_threads_per_row(d) for d in (32, 64, 96, 128, 192, 256, 512)]
    assert tprs == [8, 16, 8, 32, 16, 32, 32]
    for d in range(8, 513, 8):
        tpr = config_combine.combine_threads_per_row(d)
        assert 32 % tpr == 0 and (d // config_combine.COMBINE_VEC) % tpr == 0


def test_combine_kernel_call_matches_its_record():
    pytest.importorskip("cutlass")
    import inspect

    from flash_attn_4_sm120.kernels.combine import FlashCombine

    params = list(inspect.signature(FlashCombine.__call__).parameters)
    assert params[0] == "self" and params[-1] == "stream"
    assert tuple(params[1:-1]) == FlashCombine.ARGS.names == arguments.COMBINE_ARGS.names


def test_combine_fake_args_follow_the_record():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit

    for has_lse in (False, True):
        cfg = config_combine.CombineKernelConfig("fp32", "bf16", 128, has_lse)
        fakes = dict(zip(arguments.COMBINE_ARGS.names, jit.fake_args(arguments.COMBINE_ARGS, cfg)))
        assert (fakes["lse"] is None) == (not has_lse)
        assert fakes["out_partial"].element_type.__name__ == "Float32"
        assert fakes["out"].element_type.__name__ == "BFloat16"


def test_combine_compiles_for_sm120(monkeypatch):
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    fn, kernel = jit.compile_kernel(config_combine.CombineKernelConfig("fp32", "bf16", 64, True), with_kernel=True)
    assert fn is not None and kernel.launch_smem_bytes == 0


def test_split_forward_fake_args_are_fp32_partials():
    pytest.importorskip("cutlass")
    from dataclasses import replace

    from flash_attn_4_sm120 import jit

    tile = config.select_fwd_tile(128, 128, False)
    for varlen in (False, True):
        cfg = replace(config.FwdKernelConfig("bf16", 128, 128, tile, varlen_q=varlen), split_kv=True)
        fakes = dict(zip(arguments.FWD_ARGS.names, jit.fake_args(arguments.FWD_ARGS, cfg)))
        assert fakes["out"].element_type.__name__ == "Float32"
        assert len(fakes["out"].shape) == (4 if varlen else 5) and len(fakes["lse"].shape) == (3 if varlen else 4)
        assert fakes["q"].element_type.__name__ == "BFloat16" and len(fakes["q"].shape) == (3 if varlen else 4)


def test_combine_split_groups_rule():
    # few rows with many splits: groups share a row's splits (MQA decode B=1: 32 rows x 64 splits on 132 SMs)
    assert config_combine.combine_split_groups(32, 64, 128, 132) == config_combine.COMBINE_SPLIT_GROUPS
    # few splits: one unrolled batch per row already; many rows: the GPU is full with one group per row
    assert config_combine.combine_split_groups(32, 8, 128, 132) == 1
    assert config_combine.combine_split_groups(32 * 132 * 8, 64, 128, 132) == 1
    # the compile key and the kernel name tell the two apart
    a = config_combine.CombineKernelConfig("fp32", "bf16", 128, True)
    b = config_combine.CombineKernelConfig("fp32", "bf16", 128, True, config_combine.COMBINE_SPLIT_GROUPS)
    assert a != b and a.name() != b.name() and b.name().endswith(f"_g{config_combine.COMBINE_SPLIT_GROUPS}")
    # every head dim the combine takes fits a whole number of row groups in the CTA
    for d in range(8, config_combine.COMBINE_MAX_HEAD_DIM + 1, 8):
        groups_per_cta = config_combine.COMBINE_THREADS // config_combine.combine_threads_per_row(d)
        assert groups_per_cta % config_combine.COMBINE_SPLIT_GROUPS == 0, d
