"""Lying varlen metadata: never a crash, never an access outside the tensors given; with debug checks, a ValueError.

cu_seqlens/seqused/max_seqlen are the caller's contract and are not read on the host unless debug checks are on
(``debug_checks=True`` or ``FA4_SM120_DEBUG_CHECKS=1``).  Kernels clamp every row to the tensors they were given,
so a lie may give wrong numbers (not compared here) but must:
  (a) complete, (b) leave ``torch.cuda.synchronize()`` quiet, (c) leave memory next to the inputs untouched:
  q/k/v are slices of larger buffers filled with a sentinel, and the guard rows around them (and the inputs
  themselves) must be unchanged after the forward and the backward; outputs and gradients have the right shapes.
Guard rows catch stray writes; stray reads are compute-sanitizer's job (benchmarks/sanitize_lying_metadata.sh runs
this file under memcheck with the caching allocator off and FA4_SM120_TEST_GUARD_ROWS=0, so every tensor is its
own allocation and any out-of-bounds read or write is reported).

The debug tests (names contain "debug") check that the same lies raise ValueError naming the bad argument, with the
keyword and with the environment variable (in a subprocess: the variable is read once per process).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")

DT = torch.bfloat16
HQ, HKV, D = 4, 2, 128
LENS_Q = [5, 40, 19]
LENS_K = [30, 7, 50]
TQ, TK = sum(LENS_Q), sum(LENS_K)  # 64, 87
MAXQ, MAXK = max(LENS_Q), max(LENS_K)
B = len(LENS_Q)
SQ_DENSE, SK_DENSE = 24, 96  # dense q + fixed-size KV cache layout
GUARD_ROWS = int(os.environ.get("FA4_SM120_TEST_GUARD_ROWS", "64"))
SENTINEL = 7.0  # exact in bf16; randn data never equals it everywhere
HUGE = 2**30


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


CU_Q, CU_K = _cu(LENS_Q), _cu(LENS_K)

# id -> (layout, overrides, argument a debug check must name (a regex); None: the metadata is legal)
CASES = {
    "cu_q_end_past_total": ("varlen", dict(cu_seqlens_q=[0, 5, 45, TQ + 37]), "cu_seqlens_q"),
    "cu_k_end_past_total": ("varlen", dict(cu_seqlens_k=[0, 30, 37, TK + 100]), "cu_seqlens_k"),
    "cu_k_end_past_total_causal": ("varlen", dict(cu_seqlens_k=[0, 30, 37, TK + 100], causal=True), "cu_seqlens_k"),
    "cu_q_decreasing": ("varlen", dict(cu_seqlens_q=[0, 45, 5, TQ]), "cu_seqlens_q"),
    "cu_k_decreasing": ("varlen", dict(cu_seqlens_k=[0, 30, 7, TK]), "cu_seqlens_k"),
    "cu_k_decreasing_causal": ("varlen", dict(cu_seqlens_k=[0, 30, 7, TK], causal=True), "cu_seqlens_k"),
    "cu_q_negative_start": ("varlen", dict(cu_seqlens_q=[-16, 5, 45, TQ]), "cu_seqlens_q"),
    "cu_q_negative_start_causal": ("varlen", dict(cu_seqlens_q=[-16, 5, 45, TQ], causal=True), "cu_seqlens_q"),
    "cu_k_negative_start": ("varlen", dict(cu_seqlens_k=[-40, 30, 37, TK]), "cu_seqlens_k"),
    "cu_q_huge_length": ("varlen", dict(cu_seqlens_q=[0, HUGE, HUGE, HUGE]), "cu_seqlens_q"),
    "cu_k_huge_start": ("varlen", dict(cu_seqlens_k=[0, 30, HUGE, HUGE]), "cu_seqlens_k"),
    "cu_q_k_huge_causal": ("varlen", dict(cu_seqlens_q=[0, 5, HUGE, HUGE], cu_seqlens_k=[0, HUGE, HUGE, HUGE],
                                          causal=True), "cu_seqlens_[qk]"),
    "seqused_q_too_long": ("varlen", dict(seqused_q=[5 + 100, 40, 19]), "seqused_q"),
    "seqused_q_negative": ("varlen", dict(seqused_q=[5, -3, 19]), "seqused_q"),
    "seqused_k_too_long": ("varlen", dict(seqused_k=[30, 7 + 1000, 50]), "seqused_k"),
    "seqused_k_too_long_causal": ("varlen", dict(seqused_k=[30, 7 + 1000, 50], causal=True), "seqused_k"),
    "seqused_k_negative": ("varlen", dict(seqused_k=[-7, 7, 50]), "seqused_k"),
    "seqused_k_huge": ("varlen", dict(seqused_k=[30, HUGE, 50]), "seqused_k"),
    "kv_cache_seqused_k_too_long": ("kv_cache", dict(seqused_k=[SK_DENSE + 50, 3, SK_DENSE]), "seqused_k"),
    "kv_cache_seqused_k_negative": ("kv_cache", dict(seqused_k=[-1, 3, SK_DENSE], causal=True), "seqused_k"),
    "max_seqlen_q_too_small": ("varlen", dict(max_seqlen_q=1), "max_seqlen_q"),
    "max_seqlen_k_too_small": ("varlen", dict(max_seqlen_k=3), "max_seqlen_k"),
    "max_seqlen_q_k_too_small_causal": ("varlen", dict(max_seqlen_q=2, max_seqlen_k=2, causal=True),
                                        "max_seqlen_[qk]"),
    "max_seqlen_q_too_large": ("varlen", dict(max_seqlen_q=4 * MAXQ), None),
    "max_seqlen_k_too_large": ("varlen", dict(max_seqlen_k=4 * MAXK + 1000), None),
    "max_seqlen_both_too_large_causal": ("varlen", dict(max_seqlen_q=TQ + 500, max_seqlen_k=TK + 500, causal=True),
                                         None),
}
LIES = [name for name, (_, _, bad) in CASES.items() if bad is not None]


class Guarded:
    """A tensor of ``shape`` in the middle of a sentinel-filled buffer with GUARD_ROWS rows on each side."""

    def __init__(self, shape, gen, grad):
        row = 1
        for n in shape[1:]:
            row *= n
        self.pad = GUARD_ROWS * row
        self.n = row * shape[0]
        self.buf = torch.full((self.pad + self.n + self.pad,), SENTINEL, dtype=DT, device="cuda")
        self.t = self.buf[self.pad:self.pad + self.n].view(shape)
        self.t.copy_(torch.randn(shape, device="cuda", generator=gen).to(DT))
        self.t.requires_grad_(grad)
        self.before = self.t.detach().clone()

    def check(self, name):
        torch.cuda.synchronize()
        lo, hi = self.buf[:self.pad], self.buf[self.pad + self.n:]
        assert bool((lo == SENTINEL).all()), f"{name}: guard rows before the tensor were written"
        assert bool((hi == SENTINEL).all()), f"{name}: guard rows after the tensor were written"
        assert torch.equal(self.t.detach(), self.before), f"{name}: the input itself was modified"


def _i32(vals):
    return torch.tensor(vals, dtype=torch.int32, device="cuda")


def build(case, grad, seed=0):
    """(guarded q/k/v, kwargs for flash_attn_varlen_func) for one case of CASES."""
    layout, over, _ = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "varlen":
        shapes = ((TQ, HQ, D), (TK, HKV, D), (TK, HKV, D))
        kw = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, max_seqlen_q=MAXQ, max_seqlen_k=MAXK)
    else:
        shapes = ((B, SQ_DENSE, HQ, D), (B, SK_DENSE, HKV, D), (B, SK_DENSE, HKV, D))
        kw = dict(max_seqlen_q=SQ_DENSE, max_seqlen_k=SK_DENSE)
    kw.update(over)
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"):
        if name in kw:
            kw[name] = _i32(kw[name])
    qkv = [Guarded(s, g, grad) for s in shapes]
    return qkv, kw


def _expected_out_shape(q):
    return (*q.shape[:-1], D)


# ---------------------------------------------------------------- lies without debug checks: in bounds, no crash

@pytest.mark.parametrize("direction", ["fwd", "fwd_bwd", "fwd_bwd_deterministic"])
@pytest.mark.parametrize("case", list(CASES))
def test_lying_metadata_stays_in_bounds(request, case, direction):
    # fwd_bwd_deterministic: the fused backward's relay form (kernels/dq_relay.py), whose CTAs wait for each other's
    # turns: a lie must neither write out of bounds nor hang it (the test's timeout).  The test widens the relay to
    # every fused tile (conftest.wide_relay), whatever config_bwd.RELAY_HEAD_DIMS holds
    if direction == "fwd_bwd_deterministic":
        request.getfixturevalue("wide_relay")
    grad = direction != "fwd"
    (gq, gk, gv), kw = build(case, grad)
    q, k, v = gq.t, gk.t, gv.t
    # debug_checks=False: the lie must reach the kernels even where FA4_SM120_DEBUG_CHECKS=1 is set
    out, lse = fa.flash_attn_varlen_func(q, k, v, return_lse=True, debug_checks=False,
                                         deterministic=direction == "fwd_bwd_deterministic", **kw)
    assert out.shape == _expected_out_shape(q)
    assert lse.shape == ((HQ, q.shape[0]) if q.dim() == 3 else (q.shape[0], HQ, q.shape[1]))
    if grad:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.cuda.synchronize()  # an illegal address or a trap in any kernel surfaces here
    for name, gt in (("q", gq), ("k", gk), ("v", gv)):
        gt.check(f"{case}/{direction}/{name}")


# ---------------------------------------------------------------- debug checks: ValueError naming the argument

@pytest.mark.parametrize("direction", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("case", LIES)
def test_debug_checks_keyword_raise(case, direction):
    (gq, gk, gv), kw = build(case, grad=direction == "fwd_bwd")
    bad = CASES[case][2]
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=bad):
        fa.flash_attn_varlen_func(gq.t, gk.t, gv.t, debug_checks=True, **kw)
    torch.cuda.synchronize()
    for name, gt in (("q", gq), ("k", gk), ("v", gv)):
        gt.check(f"{case}/debug/{name}")


@pytest.mark.parametrize("case", ["max_seqlen_q_too_large", "max_seqlen_k_too_large",
                                  "max_seqlen_both_too_large_causal"])
def test_debug_checks_accept_legal_metadata(case):
    """Honest metadata (max_seqlen larger than the truth is legal) passes the debug checks, forward and backward."""
    (gq, gk, gv), kw = build(case, grad=True)
    out, _ = fa.flash_attn_varlen_func(gq.t, gk.t, gv.t, debug_checks=True, **kw)
    grads = torch.autograd.grad(out, (gq.t, gk.t, gv.t), torch.randn_like(out))
    assert [g_.shape for g_ in grads] == [gq.t.shape, gk.t.shape, gv.t.shape]
    torch.cuda.synchronize()


def test_debug_checks_accept_honest_metadata_with_seqused():
    (gq, gk, gv), kw = build("max_seqlen_q_too_large", grad=False)
    kw.update(seqused_q=_i32([5, 0, 19]), seqused_k=_i32([30, 7, 0]), max_seqlen_q=MAXQ, max_seqlen_k=MAXK)
    out, _ = fa.flash_attn_varlen_func(gq.t, gk.t, gv.t, debug_checks=True, causal=True, **kw)
    assert out.shape == _expected_out_shape(gq.t)
    torch.cuda.synchronize()


CHILD = r"""
import sys, torch
import flash_attn_4_sm120 as fa
q = torch.randn(64, 4, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(87, 2, 128, device="cuda", dtype=torch.bfloat16)
cu_q = torch.tensor([0, 5, 45, 64], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 30, 37, 87 + 100], dtype=torch.int32, device="cuda")  # end past the 87 rows of k
try:
    out, _ = fa.flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                                       max_seqlen_k=50)
    torch.cuda.synchronize()
    print("RESULT ran", tuple(out.shape))
except ValueError as exc:
    print("RESULT ValueError", str(exc).replace("\n", " "))
"""


@pytest.mark.parametrize("env_value", ["1", None], ids=["env_on", "env_unset"])
def test_debug_checks_env_var_subprocess(env_value):
    """FA4_SM120_DEBUG_CHECKS=1 turns the checks on for calls without the keyword; unset, the lie runs."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root / "torch-ext"), env.get("PYTHONPATH")) if p)
    env.pop("FA4_SM120_DEBUG_CHECKS", None)
    if env_value is not None:
        env["FA4_SM120_DEBUG_CHECKS"] = env_value
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=500,
                          cwd=str(root))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-3000:]}"
    if env_value == "1":
        assert lines[0].startswith("RESULT ValueError") and "cu_seqlens_k" in lines[0], lines[0]
    else:
        assert lines[0].startswith("RESULT ran"), lines[0]
