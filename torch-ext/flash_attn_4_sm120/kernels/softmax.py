"""Online softmax on mma.sync accumulators (CuTe-DSL device code).

Per thread, an S accumulator tile holds 2*MMA_M rows; the 4 lanes of a quad share each row.  The running row max
is kept quad-reduced (every lane holds the row's max); the running row sum is kept per lane and reduced once in
``finalize``.  Scores are in the log2 domain: p = exp2(s * scale_log2 - max * scale_log2), one FFMA + MUFU.EX2.
A row whose max is still -inf (fully masked so far) uses 0 as its offset, so no inf - inf NaN appears.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .cute_utils import LN_2, LOG2_E, acc_mn_view, quad_allreduce_max, quad_allreduce_sum, row_max, row_sum


@cute.jit
def online_softmax_step(
    acc_S: cute.Tensor,
    acc_O: cute.Tensor,
    state_max: cute.Tensor,
    state_sum: cute.Tensor,
    score,
    is_first: cutlass.Constexpr[bool],
):
    """Turn acc_S into unnormalised probabilities in place, update the running max/sum, rescale acc_O.  ``score``:
    the score hook (score.py), whose ``probs`` makes P, as in the backward, with the running max as the offset."""
    scale_log2 = score.scale_log2
    s_mn = acc_mn_view(acc_S)
    o_mn = acc_mn_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(state_max)):
        row = s_mn[r, None].load()
        prev_max = state_max[r]
        cur_max = row_max(row, -Float32.inf if const_expr(is_first) else prev_max)
        cur_max = quad_allreduce_max(cur_max)
        state_max[r] = cur_max
        safe_max = 0.0 if cur_max == -Float32.inf else cur_max
        offset = safe_max * scale_log2
        p = score.probs(row, offset)
        s_mn[r, None].store(p)
        if const_expr(is_first):
            state_sum[r] = row_sum(p)
        else:
            corr = cute.math.exp2((prev_max - safe_max) * scale_log2, fastmath=True)
            state_sum[r] = state_sum[r] * corr + row_sum(p)
            o_mn[r, None].store(o_mn[r, None].load() * corr)


@cute.jit
def softmax_finalize(
    acc_O: cute.Tensor,
    state_max: cute.Tensor,
    state_sum: cute.Tensor,
    scale_log2: Float32,
    lse: cute.Tensor,
    sink: cute.Tensor,
    has_sink: cutlass.Constexpr[bool],
):
    """Normalise acc_O by the row sums and write the natural-log LSE of each row into ``lse``.

    With a learnable sink, the sink logit joins the denominator: LSE = log(sum_j exp(s_j) + exp(sink)).
    A row with nothing to attend to gets O = 0 and LSE = -inf (or the sink logit when a sink is present).  NaN in
    the scores or the sink propagates to the row's O and LSE.
    """
    o_mn = acc_mn_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(state_max)):
        total = quad_allreduce_sum(state_sum[r])
        m = state_max[r]
        m_scaled = m * scale_log2
        if const_expr(has_sink):
            sink_scaled = sink[r] * LOG2_E
            m_scaled = sink_scaled if m == -Float32.inf else m_scaled
            # no scores and a -inf sink: nothing at all (exp2(-inf - -inf) would be NaN); a NaN sink stays NaN
            sink_term = 0.0 if m_scaled == -Float32.inf else cute.math.exp2(sink_scaled - m_scaled, fastmath=True)
            total = total + sink_term
        # NaN (from NaN scores or a NaN sink) is not "empty": it propagates to O and the LSE, never hides
        empty = total == 0.0
        inv = 1.0 if empty else cute.arch.rcp_approx(total)
        o_mn[r, None].store(o_mn[r, None].load() * inv)
        lse[r] = -Float32.inf if empty else (m_scaled + cute.math.log2(total, fastmath=True)) * LN_2
