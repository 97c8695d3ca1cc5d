"""Backward preprocess (D = rowsum(dO * O) - dLSE), CPU side: the config key and name, the thread split, the
argument record against the kernel's __call__, the fake arguments, the sm_120a compile, and the host's launch
plan (layouts, dLSE broadcasting, int32 row chunks) with the kernel replaced by the torch reference."""

import inspect
import math

import pytest
import torch

from flash_attn_4_sm120 import arguments, config, config_bwd, dispatch_bwd
from scripts import gate_lists as GL
from reference import dpsum_ref


def test_config_is_a_frozen_key_with_a_name():
    a = config_bwd.BwdPreKernelConfig("bf16", 128, False)
    assert a == config_bwd.BwdPreKernelConfig("bf16", 128) and hash(a) == hash(config_bwd.BwdPreKernelConfig("bf16", 128))
    assert a != config_bwd.BwdPreKernelConfig("bf16", 128, True) != config_bwd.BwdPreKernelConfig("fp16", 128, True)
    assert a.name() == "dpsum_bf16_dv128"
    assert config_bwd.BwdPreKernelConfig("fp16", 96, True).name() == "dpsum_fp16_dv96_dlse"
    with pytest.raises(AttributeError):
        a.head_dim_v = 64
    names = [c.name() for c in GL.bwd_pre_gate_configs()]
    assert len(set(names)) == len(names) and all(n.startswith("dpsum_") for n in names)


def test_threads_per_row_cover_the_row():
    assert [config_bwd.bwd_pre_threads_per_row(d) for d in (8, 32, 64, 96, 128, 192, 256, 512)] == [1, 4, 8, 16, 16,
                                                                                                32, 32, 32]
    for d in range(8, 513, 8):
        vectors, tpr = d // config_bwd.BWD_PRE_VEC, config_bwd.bwd_pre_threads_per_row(d)
        assert 32 % tpr == 0 and (tpr == 32 or tpr >= vectors) and (tpr == 1 or tpr < 2 * vectors)
        assert config_bwd.bwd_pre_head_dim_problem(d) is None
    for d in (0, 4, 60, 520):
        assert f"head_dim_v={d}" in config_bwd.bwd_pre_head_dim_problem(d)
    for d in config.HEAD_DIMS:  # every head dim the package takes
        assert config_bwd.bwd_pre_head_dim_problem(d) is None


def test_kernel_call_matches_its_record():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120.kernels.bwd_preprocess import FlashBwdPreprocess

    params = list(inspect.signature(FlashBwdPreprocess.__call__).parameters)
    assert params[0] == "self" and params[-1] == "stream"
    assert tuple(params[1:-1]) == FlashBwdPreprocess.ARGS.names == arguments.BWD_PRE_ARGS.names


def test_fake_args_follow_the_record():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit

    for dtype, has_dlse in (("bf16", False), ("fp16", True)):
        cfg = config_bwd.BwdPreKernelConfig(dtype, 96, has_dlse)
        fakes = dict(zip(arguments.BWD_PRE_ARGS.names, jit.fake_args(arguments.BWD_PRE_ARGS, cfg)))
        assert (fakes["dlse"] is None) == (not has_dlse)
        assert fakes["dout"].element_type.__name__ == {"bf16": "BFloat16", "fp16": "Float16"}[dtype]
        assert len(fakes["dout"].shape) == len(fakes["out"].shape) == 4 and fakes["out"].shape[-1] == 96
        assert fakes["dpsum"].element_type.__name__ == "Float32" and len(fakes["dpsum"].shape) == 3


def test_kernel_class_and_compile_for_sm120(monkeypatch):
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit
    from flash_attn_4_sm120.kernels.bwd_preprocess import FlashBwdPreprocess

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    cfg = config_bwd.BwdPreKernelConfig("bf16", 96, True)
    assert jit.kernel_class(cfg) is FlashBwdPreprocess
    fn, kernel = jit.compile_kernel(cfg, with_kernel=True)
    assert fn is not None and kernel.launch_smem_bytes == 0
    assert kernel.tpr == 16 and kernel.vecs == 1 and kernel.rows_per_cta == 8 * config_bwd.BWD_PRE_ROWS_PER_GROUP


class _FakeKernel:
    """Stands in for the compiled kernel: runs the torch reference on the views it is launched with and writes
    the result into the dpsum view (so a wrong view, a missed or doubled chunk shows in the result)."""

    def __init__(self):
        self.launches = []

    def launch(self, fn, record, dev, values):
        assert record is arguments.BWD_PRE_ARGS and set(values) == set(record.names)
        dout, out, dpsum, dlse = values["dout"], values["out"], values["dpsum"], values["dlse"]
        assert dout.dim() == out.dim() == 4 and dpsum.dim() == 3 and dpsum.stride(-1) == 1
        assert values["num_rows"] == dpsum.numel() <= dispatch_bwd.PRE_MAX_ROWS
        assert torch.isnan(dpsum).all(), "a row written twice"
        d, _ = dpsum_ref(dout, out, dlse)
        dpsum.copy_(d)
        self.launches.append(tuple(dpsum.shape))


@pytest.fixture
def fake_kernel(monkeypatch):
    fake = _FakeKernel()
    monkeypatch.setattr(dispatch_bwd, "_kernel", lambda cfg, dev: ("compiled", cfg))
    monkeypatch.setattr(dispatch_bwd, "_launch", fake.launch)
    monkeypatch.setattr(dispatch_bwd, "_PRE_KERNELS", {})
    real_empty = torch.empty
    # a fresh dpsum starts as NaN, so a row no launch wrote (or one written twice) shows
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(math.nan))
    return fake


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dlse_kind", [None, "full", "expanded"])
@pytest.mark.parametrize("max_rows", [None, 7, 40, 1000])
def test_host_launch_plan(fake_kernel, monkeypatch, varlen, dlse_kind, max_rows):
    if max_rows is not None:
        monkeypatch.setattr(dispatch_bwd, "PRE_MAX_ROWS", max_rows)
    g = torch.Generator().manual_seed(0)
    shape = (23, 3, 16) if varlen else (2, 11, 3, 16)
    out = torch.randn(*shape, generator=g).bfloat16()
    dout = torch.randn(*shape[:-1], 24, generator=g).bfloat16()[..., :16]  # strided rows, last dim contiguous
    lse_shape = (3, 23) if varlen else (2, 3, 11)
    dlse = None
    if dlse_kind == "full":
        dlse = torch.randn(*lse_shape, generator=g)
    elif dlse_kind == "expanded":  # the gradient of lse.sum(): stride 0, read in place
        dlse = torch.ones(()).expand(lse_shape)
    got = dispatch_bwd.bwd_dpsum(dout, out, dlse, varlen)
    ref, _ = dpsum_ref(dout, out, dlse, varlen)
    assert got.shape == ref.shape and got.is_contiguous() and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    sizes = [math.prod(s) for s in fake_kernel.launches]
    assert sum(sizes) == ref.numel() and max(sizes) <= dispatch_bwd.PRE_MAX_ROWS
    assert (len(sizes) == 1) == (max_rows is None or max_rows >= ref.numel())


@pytest.mark.parametrize("shape", [(0, 5, 2, 64), (2, 0, 2, 64), (2, 5, 0, 64), (0, 2, 64)])
def test_empty_tensors_launch_nothing(fake_kernel, shape):
    t = torch.zeros(shape, dtype=torch.float16)
    got = dispatch_bwd.bwd_dpsum(t, t, None, len(shape) == 3)
    assert got.numel() == 0 and fake_kernel.launches == []
    assert got.shape == ((shape[1], shape[0]) if len(shape) == 3 else (shape[0], shape[2], shape[1]))


def test_reference_is_rowsum_in_the_lse_layout():
    g = torch.Generator().manual_seed(1)
    dout, out = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    dlse = torch.randn(2, 3, 5, generator=g)
    d, mag = dpsum_ref(dout, out, dlse)
    b, s, h = 1, 4, 2
    assert math.isclose(d[b, h, s].item(), sum(dout[b, s, h, j].item() * out[b, s, h, j].item() for j in range(8))
                        - dlse[b, h, s].item(), rel_tol=1e-5, abs_tol=1e-5)
    assert (mag >= d.abs() - 1e-5).all()
    dv, magv = dpsum_ref(dout[0], out[0], dlse[0], varlen_q=True)
    torch.testing.assert_close(dv, d[0])
    torch.testing.assert_close(magv, mag[0])


def test_backward_uses_the_kernel_not_the_torch_expression():
    src = inspect.getsource(dispatch_bwd.run_backward)
    assert "bwd_dpsum(dout, out, dlse, varlen_q)" in src and ".float()" not in src
