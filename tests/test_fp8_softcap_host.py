"""Softcap on the FP8 forward, on the CPU: the configuration (config_fp8 ``softcap``, the gate's subset), the
kernel's two scalars (dispatch_fp8.fp8_scales), every entry point routing softcap to the softcap form without a
refusal, and the bad values refused before launch.  The launch runs the torch model of the kernel's contract
(tests/test_fp8_split_host.py ``model``, which caps the scores from the kernel's own arguments), so a wrong scalar,
a dropped softcap or a config without the flag moves the result by the size of the cap's effect, far past the
comparison's bar (fp32 rounding on the model's dequantized inputs).  The numbers on a GPU: the softcap tests of
tests/test_fp8_gpu.py, test_fp8_kvcache_gpu.py and test_fp8_split_gpu.py."""

import contextlib
import math
import types

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import config_fp8 as C
from flash_attn_4_sm120 import dispatch_fp8 as F8
from tests.fp8_emulation import quantize_rows
from tests.reference import attention_ref
from tests.test_fp8_split_host import model  # noqa: F401  (the kernel and combine modelled in torch, a fixture)

E4 = torch.float8_e4m3fn
LOG2_E = math.log2(math.e)


def test_the_gate_subset_and_the_flag():
    cfgs = C.all_configs()
    names = {c.name() for c in cfgs}
    capped = [c for c in cfgs if c.softcap]
    assert len(capped) == 200 and len(names) == len(cfgs) == 904
    for c in capped:  # each is a plain configuration of the list with the flag on, named so
        twin = C.Fp8FwdConfig(**{**c.__dict__, "softcap": False})
        assert twin in cfgs and C.softcap_subset(twin) and "_softcap_" in c.name()
        C.can_implement(c)
    # every other flag at both values, both head dims, every query dtype but fp16 and the decode tile
    for flag in ("causal", "local", "has_sink", "varlen", "pack_gqa", "split", "paged"):
        assert {getattr(c, flag) for c in capped} == {False, True}, flag
    assert {c.head_dim for c in capped} == set(C.FP8_HEAD_DIMS)
    assert {c.q_dtype for c in capped} == {"e4m3", "bf16"}
    assert {c.tile_m for c in capped} == {C.FP8_TILE_M, C.FP8_DECODE_TILE_M}
    assert C.all_configs() == cfgs  # deterministic
    with pytest.raises(ValueError, match="softcap must be True or False"):
        C.can_implement(C.Fp8FwdConfig(head_dim=64, head_dim_v=64, causal=False, softcap=1))
    cfg = C.select_config(128, 128, True, "bf16", varlen=True, pack_gqa=True, split=True, rows=4, softcap=True)
    assert cfg.softcap and cfg in cfgs


def test_fp8_scales():
    assert F8.fp8_scales(None, 0.0, 64) == (False, 0.125 * LOG2_E, 1.0)
    assert F8.fp8_scales(0.5, None, 64) == (False, 0.5 * LOG2_E, 1.0)
    on, pre, cap = F8.fp8_scales(None, 20.0, 128)
    assert on and pre == pytest.approx(2 * LOG2_E / math.sqrt(128) / 20.0, rel=1e-15)
    assert cap == pytest.approx(20.0 * LOG2_E, rel=1e-15)
    # the kernel's form: cap · log2e − 2 · cap · log2e / (2^x + 1), x = pre · s, equals cap · tanh(scale · s / cap)
    # in log2 units
    s = torch.linspace(-300, 300, 101, dtype=torch.float64)
    capped = cap - 2 * cap / (torch.exp2(pre * s) + 1)
    torch.testing.assert_close(capped / LOG2_E, 20.0 * torch.tanh(s / math.sqrt(128) / 20.0), rtol=1e-12, atol=1e-12)


def _dequant(x8, descale):
    """e4m3 (B, S, H, D) with a (B, Hkv) descale -> fp32 values."""
    return x8.float() * descale.repeat_interleave(x8.shape[2] // descale.shape[1], dim=1)[:, None, :, None]


def _qkv(b, sq, sk, hq, hkv, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q8 = (3 * torch.randn(b, sq, hq, d, generator=g)).to(E4)
    k8, v8 = (torch.randn(b, sk, hkv, d, generator=g).to(E4) for _ in range(2))
    desc = tuple(torch.rand(b, hkv, generator=g) + 0.5 for _ in range(3))
    return q8, k8, v8, desc


def _check(out, lse, q, k, v, softcap, **kw):
    ref, lse_ref = attention_ref(q, k, v, softcap=softcap, **kw)
    plain, _ = attention_ref(q, k, v, **kw)
    assert (ref.float() - plain.float()).abs().max() > 0.1  # the cap bends these scores
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)  # the output's bf16 rounding
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-5)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(F8, "require_cuda", lambda q, k, v: None)


@pytest.mark.parametrize("kw", [dict(pack_gqa=True, num_splits=1), dict(pack_gqa=True, num_splits=3),
                                dict(pack_gqa=False, num_splits=2)])
def test_flash_attn_func_runs_the_softcap_form(model, on_cpu, kw):
    q8, k8, v8, (qd, kd, vd) = _qkv(2, 5, 150, 4, 2, seed=1)
    out, lse = fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, softcap=4.0,
                                  return_lse=True, **kw)
    assert model and all(c["cfg"].softcap for c in model)
    assert model[0]["cfg"].split == (kw["num_splits"] > 1)
    _check(out, lse, _dequant(q8, qd), _dequant(k8, kd), _dequant(v8, vd), 4.0)


def test_the_dense_kernel_gets_the_softcap_form_and_its_scalars(monkeypatch, on_cpu):
    launches = []

    def fake_kernel(cfg, dev):
        return lambda *args: launches.append((cfg, args))

    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import device
    from flash_attn_4_sm120.kernels.fwd_fp8 import FlashFwdFp8

    monkeypatch.setattr(F8, "get_fp8_kernel", fake_kernel)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(C, "check_target", lambda arch, text: None)
    monkeypatch.setattr(device, "device_caps", lambda dev: types.SimpleNamespace(arch="sm_120a", describe=str))
    q8, k8, v8, _ = _qkv(1, 70, 70, 2, 2)
    fa.flash_attn_func(q8, k8, v8, softcap=8.0, softmax_scale=0.25, num_splits=1, pack_gqa=False)
    fa.flash_attn_func(q8, k8, v8, softmax_scale=0.25, num_splits=1, pack_gqa=False)
    (cfg, args), (cfg0, args0) = launches
    assert cfg.softcap and not cfg.varlen and cfg == C.Fp8FwdConfig(64, 64, False, softcap=True)
    idx = [FlashFwdFp8.ARG_NAMES.index(n) for n in ("scale_log2", "softcap_log2")]
    assert args[idx[0]] == pytest.approx(2 * LOG2_E * 0.25 / 8.0) and args[idx[1]] == pytest.approx(8.0 * LOG2_E)
    assert not cfg0.softcap and args0[idx[0]] == pytest.approx(0.25 * LOG2_E)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, E4])
def test_kvcache_and_varlen_run_the_softcap_form(model, on_cpu, paged, q_dtype):
    b, cap, hq, hkv = 2, 128, 4, 2
    q8, k8, v8, (qd, kd, vd) = _qkv(b, 3, cap, hq, hkv, seed=2)
    q = (3 * torch.randn(b, 3, hq, 64, generator=torch.Generator().manual_seed(5))).to(q_dtype) \
        if q_dtype != E4 else q8
    seqlens = torch.tensor([100, cap], dtype=torch.int32)
    kw = dict(k_descale=kd, v_descale=vd, q_descale=None if q_dtype != E4 else qd, softcap=3.0,
              return_softmax_lse=True, num_splits=1)
    if paged:  # pages of 16 rows, the table the identity: the contiguous rows' bytes
        pool = lambda x: x.reshape(b * cap // 16, 16, hkv, 64)  # noqa: E731
        table = torch.arange(b * cap // 16, dtype=torch.int32).view(b, cap // 16)
        out, lse = fa.flash_attn_with_kvcache(q, pool(k8), pool(v8), cache_seqlens=seqlens, page_table=table, **kw)
    else:
        out, lse = fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, **kw)
    assert model and all(c["cfg"].softcap and c["cfg"].paged == paged for c in model)
    qf = _dequant(q8, qd) if q_dtype == E4 else (lambda r: r[0].float() * r[1][..., None])(quantize_rows(q))
    for i, n in enumerate(seqlens.tolist()):
        sl = slice(i, i + 1)
        _check(out[sl], lse[sl], qf[sl], _dequant(k8, kd)[sl, :n], _dequant(v8, vd)[sl, :n], 3.0)
    # the same rows through flash_attn_varlen_func (packed q and k/v, cu_seqlens): the softcap form again
    del model[:]
    cu_k = torch.tensor([0, 100, 100 + cap], dtype=torch.int32)
    k_rows = torch.cat([k8[0, :100], k8[1]]).contiguous()
    v_rows = torch.cat([v8[0, :100], v8[1]]).contiguous()
    out_v, lse_v = fa.flash_attn_varlen_func(q.flatten(0, 1), k_rows, v_rows, cu_seqlens_q=torch.tensor(
        [0, 3, 6], dtype=torch.int32), cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=cap, softcap=3.0,
        k_descale=kd, v_descale=vd, q_descale=kw["q_descale"], return_lse=True, num_splits=1)
    assert model and all(c["cfg"].softcap for c in model)
    torch.testing.assert_close(out_v, out.flatten(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_softcap_raises_before_launch(model, on_cpu, bad):
    q8, k8, v8, (qd, kd, vd) = _qkv(1, 4, 64, 2, 2)
    before = k8.view(torch.uint8).clone()
    new = torch.randn(1, 1, 2, 64).bfloat16()
    calls = [
        lambda: fa.flash_attn_func(q8, k8, v8, softcap=bad),
        lambda: fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                                          cu_seqlens_k=torch.tensor([0, 64], dtype=torch.int32), max_seqlen_q=4,
                                          softcap=bad),
        lambda: fa.flash_attn_with_kvcache(q8, k8, v8, new, new, cache_seqlens=torch.tensor([10], dtype=torch.int32),
                                           k_descale=kd, v_descale=vd, q_descale=qd, softcap=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="softcap"):
            call()
    assert not model and torch.equal(k8.view(torch.uint8), before)  # nothing launched, the cache not written
