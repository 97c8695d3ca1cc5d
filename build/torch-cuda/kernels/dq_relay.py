"""The fused backward's dQ relay (deterministic mode, config ``dq_relay``; kernels/bwd_dkdv.py runs it).

In the fused backward every CTA (one key tile of one KV head of one batch entry) adds its dQ contribution of each
query tile it sees into the fp32 workspace with vector reductions.  fp32 addition is not associative, so the sum
depends on the order in which the CTAs' adds reach a tile.  The relay fixes that order: every (workspace tile,
query head) has an int32 turn counter, zeroed with the workspace (``dq_turns``, (tiles, Hq)), and the CTA whose
key tile is the k-th (counting from the first key tile that sees the query tile, ``first_key_tile``) waits until
the counter is k, adds, and then increments it.  The adds of one query tile are thereby made in ascending key-tile
order on every run, whatever the scheduling and the concurrent load; within a CTA each dQ element of a tile is
added once per (query head, query tile), so ordering the CTAs is enough.

Deadlock safety.  A CTA waits only for CTAs of the same (KV head, batch entry) with a lower key tile, and those were
launched before it in both launch orders of kernels/bwd_dkdv.py ``cta_coords``: the plain grid (x = key tile
varies fastest, so a lower key tile of the same (head, batch) has a lower linear block index) and the LPT order for
windowed walks (the CTA launched k-th takes key tile k // pairs, so lower key tiles have lower linear indices).
Blocks are dispatched in linear order, so every CTA a waiting CTA waits for is resident or finished; by induction
on the linear index the lowest unfinished CTA never waits, so the grid always completes, also when it runs in
many waves or shares the device with other streams.  A CTA increments a tile's counter before it waits for its
next tile's turn, so it never holds a turn while it waits.

Which CTAs contribute.  Key tile n adds to query tile m iff m is in ``BlockInfo.q_range(n)`` = [m_min(n),
m_max(n)) and n is a tile of the sequence (n * tile_n < seqlen_k).  m_min and m_max never decrease with n, so the
contributors of m are one run of consecutive key tiles, and the first is the smallest n with m_max(n) > m:
``first_key_tile`` (the forward's kv_plan n_min, pack 1).  CTAs past the sequence, past the grid (a lying
max_seqlen_k) or with no query tile are never inside that run's prefix, so no CTA waits for a turn nobody passes on:
causal and windowed walks (the first contributor is not key tile 0), varlen with empty sequences, seqused.

The wait is ``counter >= k``, not ``== k``: with honest metadata the counter of a tile is exactly the number of its
contributors that are done, so the two are the same; with lying varlen metadata that makes two sequences share a
workspace tile (their sums are wrong anyway) ``>=`` still lets every CTA through, where ``==`` could hang.

One loop (kernels/bwd_dkdv.py ``process``).  The CTA's walk is a single loop: a trip first checks the turn of the
tile whose dQ it holds in registers (lane 0 of each warp, one ``ld.acquire.gpu``, broadcast to the warp), adds it
when the turn has come and then computes the next tile, or only sleeps (``nanosleep``) when it has not.  A spin loop
inside the walk's loop (this module's ``DqRelay.wait``, the relay's first form) made ptxas allocate 188-190
registers instead of 212-214 and schedule the walk's body worse: on the H200 proxy the relay ran 0.70-0.72x the
default at d64 against 0.79-0.82x in one loop (benchmarks/experiments/README.md, session 39).  The walk visits the
query tiles in descending order, each for every query head of the GQA group (config_bwd.RELAY_HEADS_INNER), so the
key tiles of a (KV head, batch) reach a tile in step; the order inside a CTA does not touch the deadlock argument
above (a CTA still waits only for lower key tiles).

Memory ordering (the PTX model's release / acquire patterns): all threads issue their reds, the CTA barrier orders
them before thread 0's ``red.release.gpu`` increment (cumulative over what the barrier ordered); in the next CTA,
lane 0 of each warp reads the counter with ``ld.acquire.gpu`` and ``bar.warp.sync`` orders the warp's reds after
that read.  The increment is made in the CTA's next iteration, after the barrier that is there anyway
(right after it, or after the S mma: config_bwd.DQ_RELAY_RELEASE), so the reds drain under the next tile's loads
instead of stalling the CTA on the release's fence; after the last tile, behind one more barrier.

Profile: ``ncu -k regex:kernel_cutlass_kernel.*FlashBwdDkdv`` (the relay's waits show as stalls on the spin).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# nanoseconds a polling lane sleeps between two reads of a counter that is not yet at its turn
SPIN_SLEEP_NS = 32
# A cost probe for benchmarks/experiments/probe_relay_bwd.py --variants, read at trace time and not part of the compile key
# (the probe clears jit's memory cache between variants and turns the disk cache off): None (every shipped build)
# runs the relay as described above; "relaxed" passes turns with a relaxed add (no release fence), "nowait" skips
# the waits, "free" both.  Each of the three breaks the ordering, so its gradients are not reproducible: timing only.
RELAY_PROBE = None


def first_key_tile(m_block, tile_m: int, tile_n: int, windowed: bool, seqlen_q, seqlen_k, window_left):
    """The first key tile that adds to query tile ``m_block``: the smallest n with m < m_max(n) of
    BlockInfo.q_range, m_max(n) = min(M, max((n + 1) * tile_n - 1 - diag + left + tile_m, 0) // tile_m), diag =
    seqlen_k - seqlen_q.  For m < M that is (n + 1) * tile_n > m * tile_m + diag - left, so n = floor(y / tile_n)
    for y = m * tile_m + diag - left >= 0, else 0.  Not windowed: 0.  Plain integer arithmetic, so the host tests
    call it with Python ints (tests/test_bwd_relay.py) and the kernel with Int32."""
    if not windowed:
        return 0
    y = m_block * tile_m + (seqlen_k - seqlen_q) - window_left
    return cutlass.max(y, 0) // tile_n


@dsl_user_op
def ld_acquire_gpu_s32(addr, *, loc=None, ip=None) -> Int32:
    """``ld.acquire.gpu.global.b32``: a load that later memory operations of the thread cannot pass (a side effect
    for the compiler, so a spin re-reads it every iteration)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def red_release_gpu_add_s32(addr, val, *, loc=None, ip=None) -> None:
    """``red.release.gpu.global.add.s32``: add ``val`` after every memory operation ordered before it is visible
    at GPU scope."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def red_relaxed_gpu_add_s32(addr, val, *, loc=None, ip=None) -> None:
    """``red.relaxed.gpu.global.add.s32``: the add without the release's fence (RELAY_PROBE only)."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.relaxed.gpu.global.add.s32 [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dataclass(frozen=True)
class DqRelay:
    """The turn counters of one call (``mTurns``, int32 (workspace tiles, Hq)) and the block schedule whose
    ``q_range`` decides who contributes (``block``: BlockInfo of this CTA's batch entry)."""

    turns: cute.Tensor
    block: object

    def turn(self, n_block, m_block):
        """This key tile's place among the contributors of query tile ``m_block`` (0: first)."""
        b = self.block
        return n_block - first_key_tile(m_block, b.tile_m, b.tile_n, b.windowed, b.seq.seqlen_q, b.seq.seqlen_k,
                                        b.window_left)

    def offset(self, blk, head):
        """Element offset of the counter of workspace tile ``blk`` of ``head`` (kept across a loop iteration)."""
        return Int32(cute.crd2idx((blk, head), self.turns.layout))

    def address(self, off):
        return (self.turns.iterator + off).toint()

    @cute.jit
    def wait(self, off, turn):
        """Lane 0 of each warp spins until the counter at ``off`` reaches ``turn``; the warp's later memory
        operations are ordered after that read (bar.warp.sync).  Turn 0 does not read.  (The V-in-registers tile's
        relay form, which vregs_problems refuses; the dK/dV kernel's walk checks turns in one loop instead.)"""
        if const_expr(RELAY_PROBE not in ("nowait", "free")):
            if turn > 0:
                if cute.arch.lane_idx() == 0:
                    addr = self.address(off)
                    seen = ld_acquire_gpu_s32(addr)
                    while seen < turn:
                        nanosleep(SPIN_SLEEP_NS)
                        seen = ld_acquire_gpu_s32(addr)
                cute.arch.sync_warp()

    @cute.jit
    def pass_on(self, off, tidx):
        """Thread 0 passes the turn of the counter at ``off`` on (``off`` < 0: nothing pending).  Call after a CTA
        barrier that follows every thread's adds of that tile."""
        if tidx == 0 and off >= 0:
            if const_expr(RELAY_PROBE in ("relaxed", "free")):
                red_relaxed_gpu_add_s32(self.address(off), 1)
            else:
                red_release_gpu_add_s32(self.address(off), 1)
