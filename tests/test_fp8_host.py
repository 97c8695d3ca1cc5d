"""The FP8 forward's host layer on the CPU: its config's can_implement and every refusal raised before a launch."""

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import config_fp8 as C
from flash_attn_4_sm120.dispatch_fp8 import fp8_unsupported

E4 = torch.float8_e4m3fn


def _qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=64, dtype=E4):
    return (torch.zeros(b, sq, hq, d).to(dtype), torch.zeros(b, sk, hkv, d).to(dtype),
            torch.zeros(b, sk, hkv, d).to(dtype))


def test_every_selectable_config_passes_can_implement_and_fits():
    cfgs = C.all_configs()
    assert len(cfgs) == len(C.FP8_HEAD_DIMS) * 2 * len(C.FP8_OUT_DTYPES) * 2 * 2 * 2  # causal, window, sink, varlen
    for cfg in cfgs:
        C.can_implement(cfg)
        assert C.smem_bytes(cfg) <= C.SMEM_LIMIT


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=96, head_dim_v=96), "head_dim=96"),
    (dict(head_dim=128, head_dim_v=64), "head_dim_v=64"),
    (dict(out_dtype="fp32"), "out_dtype"),
    (dict(causal=1), "causal"),
    (dict(tile_m=128), "tile_m=128"),
    (dict(tile_n=48), "multiples of 32"),
    (dict(num_stages=3), "num_stages=3"),
    (dict(tile_n=512, head_dim=128, head_dim_v=128), "shared memory"),
])
def test_can_implement_names_value_and_limit(kw, match):
    args = dict(head_dim=64, head_dim_v=64, causal=False)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        C.can_implement(C.Fp8FwdConfig(**args))


def test_grad_call_raises_before_launch():
    q, k, v = _qkv()
    for i in range(3):
        args = [q, k, v]
        args[i] = args[i].clone().requires_grad_()  # e4m3 tensors can require grad
        with pytest.raises(ValueError, match="inference only"):
            fa.flash_attn_func(*args, causal=True)
    with torch.no_grad():  # the same call without grad goes on to the device check (CPU tensors here)
        with pytest.raises(ValueError, match="CUDA tensors"):
            fa.flash_attn_func(q, k, v.clone().requires_grad_())


def test_e5m2_and_mixed_dtypes_raise():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="float8_e5m2"):
        fa.flash_attn_func(q, k.to(torch.float8_e5m2), v)
    with pytest.raises(ValueError, match="bf16/fp16 query"):
        fa.flash_attn_func(q.float().bfloat16(), k, v)  # bf16 q with an e4m3 cache


def test_descales_with_bf16_inputs_raise():
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn q/k/v only"):
        fa.flash_attn_func(q, k, v, k_descale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="out_dtype"):
        fa.flash_attn_func(q, k, v, out_dtype=torch.float16)


@pytest.mark.parametrize("kw", [
    dict(softcap=5.0), dict(num_splits=2), dict(pack_gqa=True), dict(dropout_p=0.1),
    dict(page_table=torch.zeros(2, 1, dtype=torch.int32)),
    dict(score_mod=lambda *a: a[0]), dict(aux_tensors=[torch.zeros(1)]),
])
def test_unserved_features_raise_before_launch(kw):
    with pytest.raises(NotImplementedError, match="not supported with FP8 inputs"):
        fa.flash_attn_func(*_qkv(), **kw)


def test_defaults_and_one_split_are_not_refused():
    bad = fp8_unsupported(softcap=0.0, num_splits=None, pack_gqa=None, dropout_p=0.0, page_table=None)
    assert not any(bad.values())
    for ok in (dict(num_splits=0), dict(num_splits=1), dict(pack_gqa=False)):
        args = dict(softcap=0.0, num_splits=None, pack_gqa=None, dropout_p=0.0)
        args.update(ok)
        assert not any(fp8_unsupported(**args).values()), ok
    assert any(fp8_unsupported(softcap=0.0, num_splits=True, pack_gqa=None, dropout_p=0.0).values())


@pytest.mark.parametrize("window, causal, expected", [
    ((None, None), False, (False, 300, 100)),
    ((-1, -1), True, (False, 300, 0)),
    ((None, None), True, (False, 300, 0)),
    ((16, None), True, (True, 16, 0)),
    ((16, 16), True, (True, 16, 0)),  # causal fixes the right bound
    ((None, 8), False, (True, 300, 8)),
    ((5000, 5000), False, (True, 300, 100)),  # bounds past every key are clamped, still a window config
])
def test_window_bounds_follow_flash_attention(window, causal, expected):
    from flash_attn_4_sm120.dispatch_fp8 import window_bounds

    assert window_bounds(window, causal, 100, 300) == expected


@pytest.mark.parametrize("bad", [(1.5, 0), (True, 0), (1, 2, 3), "16"])
def test_window_bounds_reject_bad_values(bad):
    from flash_attn_4_sm120.dispatch_fp8 import window_bounds

    with pytest.raises(ValueError, match="window_size"):
        window_bounds(bad, False, 8, 8)


def test_sink_is_checked_and_converted():
    from flash_attn_4_sm120.dispatch_fp8 import _sink

    assert _sink(None, 4, torch.device("cpu")) is None
    out = _sink(torch.zeros(4, dtype=torch.bfloat16), 4, torch.device("cpu"))
    assert out.dtype == torch.float32 and out.is_contiguous()
    with pytest.raises(ValueError, match=r"\(Hq,\) = \(4,\)"):
        _sink(torch.zeros(2), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        _sink(torch.zeros(4, dtype=torch.int32), 4, torch.device("cpu"))


@pytest.mark.parametrize("make, exc, match", [
    (lambda q, k, v: (q, k, v, dict(q_descale=torch.ones(2, 4))), ValueError, r"shape \(batch, KV heads\) = \(2, 2\)"),
    (lambda q, k, v: (q, k, v, dict(k_descale=torch.ones(2, 2, dtype=torch.float64))), ValueError, "float32"),
    (lambda q, k, v: (q, k, v, dict(v_descale=[1.0])), ValueError, "fp32 tensor"),
    (lambda q, k, v: (q, k, v, dict(out_dtype=torch.float32)), ValueError, "out_dtype"),
    (lambda q, k, v: (q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), {}),
     ValueError, "head dims"),
    (lambda q, k, v: (q, k[:, :, :1].contiguous(), v[:, :, :1].contiguous(), {}), ValueError, None),
    (lambda q, k, v: (q[:, :, :3].contiguous(), k, v, {}), ValueError, "multiple"),
    (lambda q, k, v: (q, k, v[:, :4].contiguous(), {}), ValueError, "do not agree"),
    (lambda q, k, v: (q[0], k[0], v[0], {}), NotImplementedError, "dense"),
    (lambda q, k, v: (q, k, v, {}), ValueError, "CUDA tensors"),  # everything else is right: the CPU device
])
def test_bad_inputs_raise_naming_them(make, exc, match):
    q, k, v, kw = make(*_qkv())
    if match is None:  # Hkv 1 with Hq 4 is valid MQA: only the device is wrong
        match = "CUDA tensors"
    with pytest.raises(exc, match=match):
        fa.flash_attn_func(q, k, v, **kw)


def test_non_contiguous_rows_raise():
    q, k, v = _qkv(d=128)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        fa.flash_attn_func(q, k.transpose(1, 3), v)


def test_targets_without_the_fp8_mma_are_refused():
    for arch in ("sm_90a", "sm_120a", "sm_121a"):
        C.check_target(arch, "dev")
    with pytest.raises(ValueError, match="sm_80 cubins"):
        C.check_target("sm_80", "RTX 4090 (compute capability 8.9)")


def test_kernel_call_matches_its_fake_args():
    pytest.importorskip("cutlass")
    import inspect

    from flash_attn_4_sm120.dispatch_fp8 import fake_args
    from flash_attn_4_sm120.kernels.fwd_fp8 import FlashFwdFp8

    params = list(inspect.signature(FlashFwdFp8.__call__).parameters)
    assert params[0] == "self" and params[-1] == "stream"
    assert tuple(params[1:-1]) == FlashFwdFp8.ARG_NAMES
    assert len(fake_args(C.all_configs()[0])) == len(FlashFwdFp8.ARG_NAMES) + 1
