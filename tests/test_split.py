"""Split-KV on the host: the num_splits rule, the automatic choice, and every refusal raised before a launch (no
GPU needed: these checks run before anything touches CUDA)."""

from dataclasses import replace

import pytest
import torch

import flash_attn_4_sm120 as fa
from flash_attn_4_sm120 import config, config_combine, features, launch as L, splitkv as SK

CPU = torch.device("cpu")


def _resolve(n, **kw):
    args = dict(needs_grad=False, batch=1, ctas=8, n_blocks=512, dv=128, device=CPU)
    args.update(kw)
    return SK.resolve_num_splits(n, **args)


def test_split_kv_is_supported_in_the_table():
    assert features.FEATURES["split_kv"].supported
    features.require("split_kv")  # no raise


@pytest.mark.parametrize("n", [2, 7, 64, 256])
def test_forced_split_count_is_kept(n):
    assert _resolve(n) == n


def test_one_means_no_split():
    assert _resolve(1) == 1


@pytest.mark.parametrize("bad", [1.0, 2.5, True, "4", 2.0])
def test_num_splits_must_be_an_int(bad):
    with pytest.raises(ValueError, match="num_splits must be an int"):
        SK.check_num_splits(bad)
    q = torch.zeros(1, 4, 2, 64)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        fa.flash_attn_func(q, q, q, num_splits=bad)


def test_forced_splits_above_the_combine_limit_raise():
    with pytest.raises(ValueError, match=f"maximum {config_combine.COMBINE_MAX_SPLITS}"):
        _resolve(config_combine.COMBINE_MAX_SPLITS + 1)


def test_batch_times_splits_beyond_grid_z_raises():
    with pytest.raises(ValueError, match="grid limit 65535"):
        _resolve(256, batch=300)
    assert _resolve(255, batch=257) == 255  # 65535 exactly


def test_forced_split_with_grad_raises_and_auto_is_one():
    """A forced split with grad is compat.py's refusal (checked before any planning); automatic means 1."""
    from flash_attn_4_sm120 import compat

    with pytest.raises(ValueError, match="inference-only"):
        compat.check_call(p=0.0, dropout_p=0.0, num_splits=4, sparse=False, sparse_bwd=False, paged=False,
                          cu_seqlens_k=False, pack_gqa=None, needs_grad=True, compiling=False, mods=False,
                          score_mod=False, softcap=0.0, q=None, v=None)
    assert _resolve(0, needs_grad=True) == 1
    assert _resolve(-3, needs_grad=True) == 1


@pytest.mark.parametrize("api", ["func", "varlen", "kvcache"])
def test_requires_grad_split_call_raises_before_launch(api):
    q = torch.zeros(1, 4, 2, 64, requires_grad=True)
    k = torch.zeros(1, 4, 2, 64)
    if api == "func":
        call = lambda: fa.flash_attn_func(q, k, k, num_splits=3)  # noqa: E731
        msg = "inference-only"
    elif api == "varlen":
        call = lambda: fa.flash_attn_varlen_func(q, k, k, num_splits=3)  # noqa: E731
        msg = "inference-only"
    else:
        call = lambda: fa.flash_attn_with_kvcache(q, k, k, num_splits=3)  # noqa: E731
        msg = "inference-only"
    with pytest.raises(ValueError, match=msg):
        call()


def test_dropout_with_split_raises():
    q = torch.zeros(1, 4, 2, 64)
    with pytest.raises(ValueError, match="dropout_p=0.1 with num_splits=2"):
        fa.flash_attn_func(q, q, q, num_splits=2, dropout_p=0.1)


def test_auto_is_one_when_the_grid_fills_the_gpu():
    assert SK.auto_num_splits(ctas=512, n_blocks=32, num_sms=170, max_splits=256) == 1
    assert SK.auto_num_splits(ctas=136, n_blocks=32, num_sms=170, max_splits=256) == 1  # 80%
    assert SK.auto_num_splits(ctas=8, n_blocks=1, num_sms=170, max_splits=256) == 1  # one KV block


def test_auto_fills_the_gpu_at_batch_one():
    # B=1, 8 KV heads packed into one tile each, 32K keys in 64-key blocks on a 170-SM GPU
    n = SK.auto_num_splits(ctas=8, n_blocks=512, num_sms=170, max_splits=256)
    assert 8 <= n <= SK.AUTO_MAX_SPLITS
    assert 8 * n >= 0.8 * 170 * (-(-8 * n // 170))  # at least 80% of its last wave is busy
    # bounded by the KV blocks and by max_splits
    assert SK.auto_num_splits(ctas=1, n_blocks=5, num_sms=170, max_splits=256) <= 5
    assert SK.auto_num_splits(ctas=1, n_blocks=512, num_sms=170, max_splits=3) <= 3


def test_auto_respects_grid_z_through_resolve(monkeypatch):
    monkeypatch.setattr(SK, "sm_count", lambda dev: 10_000)
    n = _resolve(0, batch=60_000, ctas=60_000 // 50, n_blocks=512)
    assert n * 60_000 <= SK.MAX_GRID_Z


def test_auto_uses_the_cached_sm_count(monkeypatch):
    calls = []

    class Props:
        multi_processor_count = 170

    def props(dev):
        calls.append(dev)
        return Props()

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(L, "_SM_COUNT", {})
    dev = torch.device("cuda", 0)
    a = _resolve(0, device=dev)
    b = _resolve(0, device=dev)
    assert a == b > 1 and len(calls) == 1


def test_split_config_name_and_key():
    tile = config.select_fwd_tile(128, 128, False)
    base = config.FwdKernelConfig("bf16", 128, 128, tile)
    split = replace(base, split_kv=True)
    assert split != base and split.name().endswith("_split") and hash(split) != hash(base)


def test_auto_splits_min_waves_for_paged():
    # paged calls ask for two waves when the KV length allows it; the unsplit-grid rule is unchanged
    one = SK.auto_num_splits(ctas=8, n_blocks=512, num_sms=132, max_splits=256)
    two = SK.auto_num_splits(ctas=8, n_blocks=512, num_sms=132, max_splits=256, min_waves=2)
    assert 8 * one >= 0.85 * 132 and 8 * two >= 2 * 0.85 * 132 and two > one
    assert SK.auto_num_splits(ctas=512, n_blocks=32, num_sms=132, max_splits=256, min_waves=2) == 1
    # too few KV blocks for two waves: the most that helps, never more than n_blocks
    assert SK.auto_num_splits(ctas=8, n_blocks=20, num_sms=132, max_splits=256, min_waves=2) <= 20


# ---- the default (num_splits=None): automatic for inference calls ----------------------------------------------
_INFER = dict(needs_grad=False, dropout=False, block_sparse=False, compiling=False, capturing=False,
              kv_extent_static=True)


@pytest.fixture(autouse=False)
def auto_default(monkeypatch):
    monkeypatch.setattr(SK, "DEFAULT_SPLITS_AUTO", True)


def test_default_is_automatic_as_shipped():
    """On since it measured faster end to end (splitkv.DEFAULT_SPLITS_AUTO: results/generate_h100.jsonl)."""
    assert SK.DEFAULT_SPLITS_AUTO is True
    assert SK.default_num_splits(**_INFER) == 0


def test_default_is_automatic_for_an_inference_call(auto_default):
    assert SK.default_num_splits(**_INFER) == 0


@pytest.mark.parametrize("flag", ["needs_grad", "dropout", "block_sparse", "compiling"])
def test_default_never_splits_training_dropout_sparse_or_compiled_calls(flag, auto_default):
    assert SK.default_num_splits(**dict(_INFER, **{flag: True})) == 1


def test_default_under_capture_splits_only_a_static_kv_extent(auto_default):
    assert SK.default_num_splits(**dict(_INFER, capturing=True)) == 0  # k's shape: fixed for the graph
    assert SK.default_num_splits(**dict(_INFER, capturing=True, kv_extent_static=False)) == 1  # max_seqlen_k given
    assert SK.default_num_splits(**dict(_INFER, kv_extent_static=False)) == 0  # eager: read per call


def test_default_switch_restores_no_split(monkeypatch):
    monkeypatch.setattr(SK, "DEFAULT_SPLITS_AUTO", False)
    assert SK.default_num_splits(**_INFER) == 1


def test_default_splits_an_underfilled_decode_grid_and_not_a_full_one(monkeypatch, auto_default):
    """The automatic count the default leads to: B=1 decode (8 KV heads, 32K keys in 64-key blocks) on 132 SMs
    splits; a prefill grid that fills the SMs does not."""
    monkeypatch.setattr(SK, "sm_count", lambda device: 132)
    n = SK.default_num_splits(**_INFER)
    assert _resolve(n, ctas=8, n_blocks=512) > 1
    assert _resolve(n, ctas=4 * 132, n_blocks=512) == 1


def test_signatures_default_to_none_and_kvcache_to_automatic():
    import inspect

    for fn in (fa.flash_attn_func, fa.flash_attn_varlen_func):
        assert inspect.signature(fn).parameters["num_splits"].default is None
    assert inspect.signature(fa.flash_attn_with_kvcache).parameters["num_splits"].default == 0


def test_none_is_the_default_not_a_bad_value():
    assert SK.check_num_splits(None) == 1  # checked as one split; resolved per call


# ---- devices without programmatic dependent launch (SM80/SM86/SM89): no split -------------------------------
def _caps(cap):
    from flash_attn_4_sm120 import device as DV

    return DV.caps_from_properties("test GPU", *cap, None, None, 80)


def test_no_split_where_the_device_lacks_pdl(monkeypatch):
    monkeypatch.setattr(SK, "sm_count", lambda device: 132)
    ampere = _caps((8, 6))
    assert _resolve(0, caps=ampere) == 1  # automatic: no split there
    with pytest.raises(ValueError, match=r"num_splits=4: .*griddepcontrol.*test GPU \(compute capability 8\.6\)"):
        _resolve(4, caps=ampere)
    assert _resolve(4, caps=_caps((12, 0))) == 4
    assert _resolve(0, caps=_caps((12, 0))) > 1
