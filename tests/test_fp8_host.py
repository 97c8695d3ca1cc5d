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
    unsplit = len(C.FP8_HEAD_DIMS) * 2 * len(C.FP8_OUT_DTYPES) * 2 * 2  # causal, window, sink
    # dense + varlen unsplit, varlen packed, split (fp32 partials) packed or not
    split = len(C.FP8_HEAD_DIMS) * 2 * 2 * 2 * 2  # causal, window, sink, packed
    # + every packed configuration again with the key-split decode tile
    contiguous = 2 * unsplit + unsplit + split + (unsplit + split // 2)
    # + every varlen configuration again with paged K/V (all but the dense unsplit ones)
    e4m3 = contiguous + (contiguous - unsplit)
    # + every varlen one (contiguous or paged) with a bf16/fp16 query quantized in the kernel: unsplit ones with
    # q_dtype = their out_dtype, split ones with either
    varlen_split = 2 * (split + split // 2)
    plain = e4m3 + (e4m3 - unsplit - varlen_split) + 2 * varlen_split
    # + softcap on the subset config_fp8.softcap_subset names (tests/test_fp8_softcap_host.py checks which)
    assert len(cfgs) == plain + sum(C.softcap_subset(c) for c in cfgs[:plain])
    assert not any(c.softcap for c in cfgs[:plain])
    assert all(c.varlen and (c.split or c.out_dtype == c.q_dtype) for c in cfgs if c.q_dtype != "e4m3")
    assert all(c.varlen for c in cfgs if c.paged)
    assert all(c.pack_gqa for c in cfgs if c.tile_m == C.FP8_DECODE_TILE_M)
    assert len({c.name() for c in cfgs}) == len(cfgs)
    assert all(c.varlen for c in cfgs if c.pack_gqa or c.split)
    assert {c.out_dtype for c in cfgs if c.split} == {C.SPLIT_OUT_DTYPE}
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
    (dict(pack_gqa=True), "pack_gqa=True needs varlen=True"),
    (dict(split=True, out_dtype="fp32"), "split=True needs varlen=True"),
    (dict(split=True, varlen=True), "out_dtype='bf16' with split=True"),
    (dict(out_dtype="fp32", varlen=True), "out_dtype='fp32'"),
    (dict(pack_gqa=1, varlen=True), "pack_gqa must be True or False"),
    (dict(paged=True), "paged=True needs varlen=True"),
    (dict(paged=1, varlen=True), "paged must be True or False"),
    (dict(tile_m=16, num_warps=1, varlen=True), "tile_m=16 is the packed decode tile"),
    (dict(tile_m=16, num_warps=2, kv_warps=2, varlen=True), "tile_m=16 is the packed decode tile"),
    (dict(tile_m=16, num_warps=2, kv_warps=1, varlen=True, pack_gqa=True), "tile_m=16 must be 16 x num_warps=2"),
    (dict(tile_m=16, num_warps=3, kv_warps=2, varlen=True, pack_gqa=True), "kv_warps=2 must be a positive divisor"),
    (dict(tile_m=16, num_warps=1, kv_warps=0, varlen=True, pack_gqa=True), "kv_warps=0"),
    (dict(tile_m=32, num_warps=4, kv_warps=2, varlen=True, pack_gqa=True), "serves the packed decode tile"),
    (dict(tile_m=16, num_warps=4, kv_warps=4, varlen=True, pack_gqa=True), "tile_n=64 / kv_warps=4"),
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
    dict(dropout_p=0.1),
    dict(page_table=torch.zeros(2, 1, dtype=torch.int32)),
    dict(score_mod=lambda *a: a[0]), dict(aux_tensors=[torch.zeros(1)]),
])
def test_unserved_features_raise_before_launch(kw):
    with pytest.raises(NotImplementedError, match="not supported with FP8 inputs"):
        fa.flash_attn_func(*_qkv(), **kw)


def test_split_and_pack_are_served_not_refused():
    for ok in (dict(num_splits=0), dict(num_splits=1), dict(num_splits=8), dict(pack_gqa=True), dict(pack_gqa=False),
               dict(softcap=30.0)):
        args = dict(softcap=0.0, num_splits=None, pack_gqa=None, dropout_p=0.0, page_table=None)
        args.update(ok)
        assert not any(fp8_unsupported(**args).values()), ok
    assert any(fp8_unsupported(softcap=1.0, dropout_p=0.1).values())


@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_splits=2.0), ValueError, "num_splits must be an int"),
    (dict(num_splits=True), ValueError, "num_splits must be an int"),
    (dict(pack_gqa="yes"), ValueError, "pack_gqa must be None, True or False"),
])
def test_bad_split_and_pack_values_are_named(packed_runs, kw, exc, match):
    with pytest.raises(exc, match=match):
        fa.flash_attn_func(*_qkv(), **kw)
    assert not packed_runs


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


@pytest.fixture
def packed_runs(monkeypatch):
    """Stub the device check and both FP8 launches; records which one a dense call took, with its arguments."""
    from flash_attn_4_sm120 import dispatch_fp8 as F8

    calls = []

    def fake_packed(q, k, v, cu_q, cu_k, used_k, max_q, descales, **kw):
        calls.append(dict(path="packed", q=q, k=k, cu_q=cu_q, cu_k=cu_k, used_k=used_k, max_q=max_q, **kw))
        total_q, hq = q.shape[1], q.shape[2]
        return (torch.zeros(1, total_q, hq, v.shape[3], dtype=kw["out_dtype"]),
                torch.arange(hq * total_q, dtype=torch.float32).view(1, hq, total_q))

    def fake_dense(q, k, v, descales, **kw):
        calls.append(dict(path="dense", **kw))
        b, sq, hq = q.shape[:3]
        return torch.zeros(b, sq, hq, v.shape[3], dtype=kw["out_dtype"]), torch.zeros(b, hq, sq)

    monkeypatch.setattr(F8, "require_cuda", lambda q, k, v: None)
    monkeypatch.setattr(F8, "run_fp8_packed", fake_packed)
    monkeypatch.setattr(F8, "run_fp8_forward", fake_dense)
    return calls


@pytest.mark.parametrize("kw, sq, path", [
    (dict(), 8, "dense"),  # Hq/Hkv = 2, 8 rows: 16 packed rows fill a quarter tile -> packed
    (dict(), 40, "dense"),  # 40 rows fill over half a 64-row tile: no packing, no split (few keys)
    (dict(pack_gqa=False), 8, "dense"),
    (dict(pack_gqa=True), 40, "packed"),
    (dict(num_splits=3), 40, "packed"),
    (dict(num_splits=0), 40, "packed"),  # automatic: the kernel form that can split (fp8_splits decides)
])
def test_dense_calls_that_pack_or_split_run_on_packed_rows(packed_runs, kw, sq, path):
    q, k, v = _qkv(b=2, sq=sq, sk=16, hq=4, hkv=2)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)
    (c,) = packed_runs
    expect = "packed" if (path == "packed" or (not kw and sq == 8)) else "dense"
    assert c["path"] == expect
    assert out.shape == (2, sq, 4, 64) and lse.shape == (2, 4, sq)
    if expect == "packed":
        assert c["q"].shape == (1, 2 * sq, 4, 64) and c["q"].data_ptr() == q.data_ptr()  # views, no copy
        assert c["k"].shape == (1, 32, 2, 64) and c["k"].data_ptr() == k.data_ptr()
        assert c["cu_q"].tolist() == [0, sq, 2 * sq] and c["used_k"].tolist() == [16, 16]
        assert c["max_q"] == sq and c["max_seqlen_k"] == 16 and c["rows_covered"] is True
        assert c["num_splits"] == kw.get("num_splits", 1) and c["pack_gqa"] == kw.get("pack_gqa")
        # lse (1, Hq, total_q) back to (B, Hq, Sq): sequence 1, head 3, row 2 = packed row sq + 2
        assert lse[1, 3, 2].item() == 3 * 2 * sq + sq + 2


def test_a_split_over_kv_that_cannot_be_read_as_rows_is_refused(packed_runs):
    q, k, v = _qkv(b=2, sq=40, sk=32, hq=4, hkv=2)
    with pytest.raises(NotImplementedError, match="num_splits=2 with k/v strides"):
        fa.flash_attn_func(q, k[:, :16], v[:, :16], num_splits=2)
    fa.flash_attn_func(q, k[:, :16], v[:, :16])  # unsplit: the dense kernel reads the strided view
    assert [c["path"] for c in packed_runs] == ["dense"]


@pytest.mark.parametrize("pack, rows, tile", [(True, 4, 16), (True, 16, 16), (True, 17, 64), (False, 1, 64),
                                              (True, None, 64)])
def test_packed_decode_rows_select_the_key_split_tile(pack, rows, tile):
    for split in (False, True):
        cfg = C.select_config(128, 128, True, "bf16", varlen=True, pack_gqa=pack, split=split, rows=rows)
        kv = C.FP8_DECODE_KV_WARPS if tile == C.FP8_DECODE_TILE_M else 1
        assert (cfg.tile_m, cfg.num_warps, cfg.kv_warps) == (tile, tile // 16 * kv, kv)
        assert cfg in C.all_configs()  # the gate's worklist holds every configuration the host selects
