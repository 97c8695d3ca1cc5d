"""The cheap host path of a call keeps the behaviour of the plain checks it replaced: the window bounds, the scalars
and the stride alignment of validate.py against reference versions written out loop by loop (the code before the
inline versions), and the backward of a training call (the plan key the forward hands it, the fused-backward memo
in the plan, the dout checks autograd leaves to it).  CPU only: the device, the compiler and the launches are
stubbed (scripts/stub_device.py, through tests/plan_grid.py)."""

import enum
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from flash_attn_4_sm120 import dispatch, dispatch_bwd, flash_attn_func, flash_attn_varlen_func
from flash_attn_4_sm120 import plan as P
from flash_attn_4_sm120 import validate as V
from flash_attn_4_sm120.config import WINDOW_UNBOUNDED

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_grid  # noqa: E402


# ---- validate.py: reference versions ----------------------------------------------------------------------------
def _ref_window(causal, window_size):
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    bounds = []
    for side, w in zip(("left", "right"), window_size):
        if w is None or (isinstance(w, int) and w < 0):
            bounds.append(WINDOW_UNBOUNDED)
        elif isinstance(w, bool) or not isinstance(w, int):
            raise ValueError(f"window_size {side} bound must be an int or None, got {w!r}")
        else:
            bounds.append(min(w, WINDOW_UNBOUNDED))
    return bounds[0], 0 if causal else bounds[1]


def _ref_scalars(softmax_scale, softcap, head_dim):
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    try:
        softmax_scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"softmax_scale must be a number, got {softmax_scale!r}") from None
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    softcap = 0.0 if softcap is None else float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    derived = [softmax_scale * 1.4426950408889634]
    if softcap > 0:
        derived += [softcap * 1.4426950408889634, softmax_scale / softcap]
    if max(derived) > 3.4028234663852886e38:
        raise ValueError("overflows fp32")
    return softmax_scale, softcap


def _outcome(fn, *args):
    """(result, None) or (None, (exception type, message)), for comparing two implementations."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
        return None, (type(exc), str(exc))


class _Side(enum.IntEnum):
    SHORT = 7
    NEGATIVE = -3


_BOUNDS = (None, 0, 1, 63, 1 << 29, (1 << 29) + 1, 1 << 40, -1, -100, True, False, 2.0, 2.5, "3", _Side.SHORT,
           _Side.NEGATIVE)


@pytest.mark.parametrize("causal", [False, True])
def test_window_bounds_match_the_reference(causal):
    shapes = [None, (1,), (1, 2, 3), "ab", 5]
    shapes += [(a, b) for a, b in itertools.product(_BOUNDS, repeat=2)]
    shapes += [[a, b] for a, b in itertools.product(_BOUNDS[:8], repeat=2)]  # a list pair too
    for window in shapes:
        got, want = _outcome(V.resolve_window, causal, window), _outcome(_ref_window, causal, window)
        assert got == want, window
        if got[0] is not None:
            assert [type(x) for x in got[0]] == [type(x) for x in want[0]], window


def test_scalars_match_the_reference():
    scales = (None, 0.125, 1.0, 1e29, 1e30, 1e39, 0.0, -0.5, math.inf, math.nan, 1, 2, True, "x", torch.tensor(0.25))
    softcaps = (None, 0.0, -0.0, 0, 5.0, 1e-41, -1.0, math.nan, math.inf, False, torch.tensor(0.0))
    for scale, softcap in itertools.product(scales, softcaps):
        for head_dim in (64, 96, 256):
            got, want = _outcome(V.check_scalars, scale, softcap, head_dim), \
                _outcome(_ref_scalars, scale, softcap, head_dim)
            assert (got[0] is None) == (want[0] is None), (scale, softcap)
            if got[0] is not None:
                assert got[0] == want[0] and all(type(x) is float for x in got[0]), (scale, softcap)
                assert math.copysign(1, got[0][1]) == math.copysign(1, want[0][1])  # -0.0 stays -0.0
            else:
                assert got[1][0] is ValueError and want[1][0] is ValueError, (scale, softcap)


def _ref_misaligned(t):
    if t.data_ptr() % 16:
        return True
    return any(s % 8 for s in t.stride()[:-1]) and t.numel() > 0


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
def test_stride_alignment_matches_the_reference(rank):
    base = torch.zeros(4096, dtype=torch.bfloat16)
    cases = []
    for lead in itertools.product((0, 8, 12, 64, 136), repeat=rank - 1):
        for offset in (0, 8, 3):
            for shape0 in (0, 1, 2):
                shape = (shape0,) + (2,) * (rank - 2) + (8,)
                cases.append(base[offset:].as_strided(shape, (*lead, 1)))

    class OnCuda(torch.Tensor):  # a CPU tensor that passes the placement check (as the stub's)
        is_cuda = True
        __torch_function__ = torch._C._disabled_torch_function_impl

    for t in cases:
        _, err = _outcome(V.check_tensor, "x", t.as_subclass(OnCuda), rank)
        assert (err is not None) == _ref_misaligned(t), (t.shape, t.stride(), t.storage_offset())
        if err is not None:
            assert err[0] is ValueError and "16-byte aligned" in err[1] and str(tuple(t.stride())) in err[1]


# ---- the backward of a training call ----------------------------------------------------------------------------
def _t(*shape, dtype=torch.bfloat16, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def _training_calls():
    """(name, call) pairs, each a no-argument function running one forward + backward through the public API."""
    def dense(d=64, dv=None, hq=4, hkv=2, sq=40, sk=70, **kw):
        def run():
            q, k, v = _t(2, sq, hq, d), _t(2, sk, hkv, d, seed=1), _t(2, sk, hkv, dv or d, seed=2)
            out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
            (out.float().sum() + lse.sum()).backward()
        return run

    def varlen(**kw):
        def run():
            cu = torch.tensor([0, 17, 17, 60], dtype=torch.int32)
            q, k, v = _t(60, 4, 64), _t(60, 2, 64, seed=1), _t(60, 2, 64, seed=2)
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=43,
                                         max_seqlen_k=43, **kw)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        return run

    sink = torch.zeros(4, dtype=torch.float32)
    return [
        ("dense", dense()), ("causal", dense(causal=True)), ("window", dense(window_size=(16, 3))),
        ("softcap", dense(softcap=5.0)), ("d128_dv64", dense(d=128, dv=64)), ("mha_d96", dense(d=96, hkv=4)),
        ("deterministic", dense(deterministic=True)), ("sink", dense(learnable_sink=sink.clone().requires_grad_())),
        ("dropout", dense(dropout_p=0.3, dropout_seed=5)), ("dropout_high_p", dense(dropout_p=0.99, dropout_seed=5)),
        ("dropout_one", dense(dropout_p=1.0, dropout_seed=5)),
        ("dropout_seed_tensor", dense(dropout_p=0.3, dropout_seed=torch.tensor([9], dtype=torch.int64))),
        ("varlen", varlen()), ("varlen_causal", varlen(causal=True)),
    ]


@pytest.mark.parametrize("tma", [True, False])
def test_backward_looks_up_the_key_it_would_build(monkeypatch, tma):
    """The key the forward hands the backward (FwdMeta.plan_key, plan.backward_key) is the key run_backward builds
    itself without it (the torch.library op's path), for every feature the training grid covers."""
    seen = []
    real_get, real_run = P.get_plan, dispatch_bwd.run_backward
    monkeypatch.setattr(P, "get_plan", lambda key: seen.append(key) or real_get(key))

    def run_twice(dout, q, k, v, out, lse, meta, **kw):
        before = len(seen)
        rebuilt = real_run(dout, q, k, v, out, lse, meta._replace(plan_key=None), **kw)
        handed = real_run(dout, q, k, v, out, lse, meta, **kw)
        keys = seen[before:]
        assert len(keys) in (0, 2) and (not keys or keys[0] == keys[1]), keys
        assert meta.plan_key is None or keys, "a key handed over but never looked up"
        checked.append(meta.plan_key is not None)
        for a, b in zip(rebuilt, handed):
            assert (a is None) == (b is None)
        return handed

    from flash_attn_4_sm120 import autograd
    monkeypatch.setattr(autograd, "run_backward", run_twice)
    for name, call in _training_calls():
        checked = []
        with plan_grid.stubbed(tma, []):
            call()
        assert checked == [True], name  # one backward, with the forward's key


def test_backward_key_is_the_forward_key_but_high_p():
    key = P.PlanKey("bf16", 64, 64, needs_grad=True, dropout=True, dropout_high_p=True)
    assert P.backward_key(key) == key._replace(dropout_high_p=False)
    assert P.backward_key(key._replace(dropout_high_p=False)) is not None
    assert P.backward_key(key._replace(sparse=(1, 1, 128, 128))) is None  # built from the saved block sizes
    assert P.backward_key(key._replace(paged=True)) is None


def test_fused_backward_is_memoised_in_the_plan(monkeypatch):
    calls = []
    real = dispatch_bwd.fused_for
    monkeypatch.setattr(dispatch_bwd, "fused_for",
                        lambda cfg, relay=False: calls.append((cfg, relay)) or real(cfg, relay))
    launched = []
    with plan_grid.stubbed(True, launched):
        run = dict(_training_calls())["causal"]
        run()
        run()
        assert len(calls) == 1 and launched  # asked once for the plan, then read from it
        assert any(cfg.__class__.__name__ == "BwdKernelConfig" and cfg.fused_dq for cfg, _ in launched)
        dispatch_bwd.clear_caches()  # drops the plans, and the fused kernels with them
        run()
        assert len(calls) == 2
        # deterministic=True: the relay form, memoised beside the default in its plan
        launched.clear()
        det = dict(_training_calls())["deterministic"]
        det()
        det()
        assert [relay for _, relay in calls[2:]] == [True]
        assert any(getattr(cfg, "dq_relay", False) for cfg, _ in launched)


def _misaligned_gout(shape):
    """A gradient whose last dim is contiguous and 16-byte aligned but whose rows are not (stride 132 elements)."""
    b, s, h, d = shape
    return torch.ones(b, s, h, d + 4, dtype=torch.bfloat16)[..., :d]


def test_autograd_dout_checks_give_the_same_errors():
    """The autograd path checks only dout's row alignment (own_out): the error is check_tensor's, the same the op's
    path gives; a dout autograd can make contiguous (stride(-1) != 1, or expanded) still runs."""
    with plan_grid.stubbed(True, []):
        q, k, v = _t(1, 24, 4, 128), _t(1, 24, 4, 128, seed=1), _t(1, 24, 4, 128, seed=2)
        out, _ = flash_attn_func(q, k, v, causal=True)
        gout = _misaligned_gout(out.shape)
        with pytest.raises(ValueError, match=r"dout rows must be 16-byte aligned .*132"):
            out.backward(gout)
        # the same tensors through the op's path (every check): the same message
        o, lse, meta, _ = dispatch.run_forward(q.detach(), k.detach(), v.detach(), causal=True, needs_grad=True)
        with pytest.raises(ValueError, match=r"dout rows must be 16-byte aligned .*132"):
            dispatch_bwd.run_backward(gout, q, k, v, o, lse, meta)
        with pytest.raises(ValueError, match="dout has shape"):
            dispatch_bwd.run_backward(torch.ones_like(o)[:, :5], q, k, v, o, lse, meta)
        with pytest.raises(ValueError, match="dout has dtype"):
            dispatch_bwd.run_backward(o.half(), q, k, v, o, lse, meta)
        for fine in (torch.ones((), dtype=torch.bfloat16).expand(out.shape), torch.ones_like(out).transpose(1, 2).contiguous()
                     .transpose(1, 2), torch.ones(out.shape, dtype=torch.float32)):
            q.grad = None
            flash_attn_func(q, k, v, causal=True)[0].backward(fine)  # autograd casts the fp32 one to out's dtype
            assert q.grad is not None and q.grad.shape == q.shape


def test_saved_inputs_still_catch_an_in_place_change():
    """autograd.FlashAttnFunction saves detached views of q, k, v (no detach per backward launch); they share the
    inputs' version counter, so changing an input in place between forward and backward still raises."""
    with plan_grid.stubbed(True, []):
        for name in ("q", "k", "v"):
            leaves = {n: _t(1, 24, 4, 64, seed=i) for i, n in enumerate("qkv")}
            tensors = {n: t * 1 for n, t in leaves.items()}  # non-leaves, so an in-place change is allowed
            out, _ = flash_attn_func(tensors["q"], tensors["k"], tensors["v"], causal=True)
            tensors[name].add_(1)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.float().sum().backward()
        q, k, v = (_t(1, 24, 4, 64, seed=i) for i in range(3))
        out, _ = flash_attn_func(q, k, v, causal=True)
        assert not any(t.requires_grad for t in out.grad_fn.saved_tensors[:3])
        out.float().sum().backward()
        assert all(t.grad is not None for t in (q, k, v))
