"""benchmarks/refcheck.py (the benchmarks' correctness reference, plain torch) against autograd through
tests/reference.py, on the CPU: forward and the per-group backward, both causal alignments, row chunks."""

import sys
from pathlib import Path

import pytest
import torch

from reference import attention_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import refcheck  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37)])
def test_forward_and_group_backward_match_autograd(monkeypatch, causal, sq, sk):
    monkeypatch.setattr(refcheck, "ROWS_PER_CHUNK", 8)  # several chunks, the last one partial
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, sq, 4, 16), (2, sk, 2, 16),
                                                                             (2, sk, 2, 8)))
    dout = torch.randn(2, sq, 4, 8, generator=g, dtype=torch.float64)
    ins = tuple(t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nan_to_num(attention_ref(*ins, causal=causal, upcast=False)[0])  # rows without keys: 0
    dq, dk, dv = torch.autograd.grad(out, ins, dout)
    assert (refcheck.forward(q, k, v, causal, dtype=torch.float64) - out).abs().max().item() < 1e-5
    for b in range(2):
        for h in range(2):
            rq, rk, rv = refcheck.backward_one_group(q, k, v, dout, causal, b, h, dtype=torch.float64)
            assert (rq - dq[b, :, 2 * h:2 * h + 2]).abs().max().item() < 1e-5
            assert (rk - dk[b, :, h]).abs().max().item() < 1e-5
            assert (rv - dv[b, :, h]).abs().max().item() < 1e-5


def test_check_passes_the_same_dtype_result_and_fails_a_wrong_one():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 40, h, 16, generator=g).bfloat16() for h in (4, 2, 2))
    ref = refcheck.forward(q, k, v, True)
    same = refcheck.forward(q, k, v, True, dtype=torch.bfloat16)
    assert refcheck.check("out", same, ref, same)[2] is None
    err, bar, problem = refcheck.check("out", ref + 0.5, ref, same)
    assert err == pytest.approx(0.5) and problem.startswith("out: max error") and str(f"{bar:.3e}") in problem
    assert "non-finite" in refcheck.check("out", ref * float("nan"), ref, same)[2]
