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
launched before it in every launch order of kernels/bwd_dkdv.py ``cta_coords``: the plain grid (x = key tile
varies fastest, so a lower key tile of the same (head, batch) has a lower linear block index), the LPT order for
windowed walks (the CTA launched k-th takes key tile k // pairs, so lower key tiles have lower linear indices) and
the relay's grouped order (``relay_launch_coords``: the same inside each group of pairs).
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

Memory ordering (the PTX model's release / acquire patterns): all threads issue their reds, the CTA barrier orders
them before thread 0's ``red.release.gpu`` increment (cumulative over what the barrier ordered); in the next CTA,
lane 0 of each warp spins with ``ld.acquire.gpu`` until its turn and ``bar.warp.sync`` orders the warp's reds
after the acquire.  The increment is made in the CTA's next iteration, after the barrier that is there anyway
(right after it, or after the S mma: config_bwd.DQ_RELAY_RELEASE), so the reds drain under the next tile's loads
instead of stalling the CTA on the release's fence; after the last tile, behind one more barrier.

Where the time went (main at 14e070b, relay / default 0.71-0.75 at d64 and 0.55-0.73 at d128 on an H200,
benchmarks/experiments/results/relay_bwd_h200_s35.jsonl), read from the code and its SASS (sm_120a):
* The wait was already only around the adds (dQ = dS K is in registers before the spin), but the spin's first read
  came right after the dQ mma and its value was needed at once: every warp paid one L2 round trip of
  ``LDG.E.STRONG.GPU`` + ``CCTL.IVALL`` per query tile even when the turn had long come.  Now that read is issued
  early (``DQ_RELAY_PREFETCH``: before the dK mma, kernels/bwd_dkdv.py) and only compared at the adds; a spin
  re-reads only when the turn has not come.  The early read is an acquire too, so the adds that follow it in
  program order (and, through ``bar.warp.sync``, the other lanes' adds) are ordered after it, as before.
* The wavefront.  Every CTA of a (KV head, batch) starts at the same query tile, and in the plain launch order all
  of a pair's key tiles are dispatched in one burst: CTA n cannot add before CTAs 0..n-1 each added and passed the
  turn on, so it idles about n hops (one hop: the reds, the barrier, the release's ``MEMBAR.ALL.GPU``, the
  counter's trip through L2, the acquire) before its first add, in every wave (the slots a wave frees go to the
  next pair's key tiles in a burst again).  A rotated start cannot remove that: whatever tile CTA n visits first,
  the n CTAs before it in the (fixed, launch-ordered) turn order must have added there first, one hop each, so its
  first add comes at least n hops after the first CTA's, whatever the walk order; and if the walks are rotated
  against each other, some tile is visited by CTA n before CTA n-1 (each walk visits every tile once, so the
  visit steps cannot all grow with n), where CTA n then waits most of a walk.  Staggering in time does remove it:
  the grouped launch order (``relay_launch_coords``, ``config_bwd.RELAY_GROUP_KIB``) dispatches key tile n of a
  group of pairs after key tile n-1 of all of them, so a pair's key tiles reach the GPU one slot-release apart
  instead of in one burst; after the first band of the first wave each CTA finds its predecessors' turns passed
  (or passing) when it arrives.  The group is sized so that its pairs' Q, dO and fp32 dQ stay in L2 (the plain
  order's advantage: a pair's key tiles read each Q/dO tile within one hop of each other), but holds at least
  ``config_bwd.RELAY_GROUP_MIN_PAIRS`` pairs (with fewer, a pair's resident key tiles come in bursts again).
* The release: thread 0's ``red.release.gpu`` is ``MEMBAR.ALL.GPU`` + ``REDG``; the fence waits for the CTA's reds
  to reach L2 and stalls warp 0, which the next CTA barrier passes on to every warp.  Unchanged here (moving it
  later, ``DQ_RELAY_RELEASE = "after_s"``, measured 1-4% slower: the next CTA waits longer).

Deadlock safety of the grouped order: within a group, CTA lin takes key tile r // size of pair r % size (r: its
index in the group), so a pair's key tiles keep ascending linear indices, and a pair lies in one group: the
argument above holds unchanged (tests/test_bwd_relay.py plays it out).

Profile: ``ncu -k regex:kernel_cutlass_kernel.*FlashBwdDkdv`` (the relay's waits show as stalls on the spin).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# nanoseconds a polling lane sleeps between two reads of a counter that is not yet at its turn
SPIN_SLEEP_NS = 32


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


def relay_group_pairs(num_n_blocks, pairs, qheads_per_kvhead, key_tiles_in_budget: int, min_pairs: int):
    """(KV head, batch) pairs per group of the relay's launch order: as many as keep the group's Q, dO and fp32 dQ
    within the L2 budget (``key_tiles_in_budget``: how many key tiles' worth of those rows, per query head, the budget
    holds, config_bwd.relay_key_tiles_in_budget), but at least ``min_pairs`` (config_bwd.RELAY_GROUP_MIN_PAIRS: fewer
    pairs per group launch each pair's key tiles in bursts again), at most every pair.  Plain integer arithmetic (host
    tests call it with Python ints, the kernel with Int32); no product of runtime values, so no overflow."""
    per_pair = cutlass.max(num_n_blocks * qheads_per_kvhead, 1)
    return cutlass.max(cutlass.min(cutlass.max(key_tiles_in_budget // per_pair, min_pairs), pairs), 1)


def relay_launch_coords(lin, num_n_blocks, num_kv_heads, pairs, group):
    """(key tile, KV head, batch) of the CTA launched ``lin``-th in the relay's grouped order: the pairs (KV head
    fastest, then batch) in groups of ``group`` (the last one may be smaller), and inside a group key tile n of every
    pair before key tile n + 1 of any.  A bijection of [0, num_n_blocks * pairs) (tests/test_bwd_relay.py); a pair's
    key tiles keep ascending linear indices (the deadlock argument above).  Plain integer arithmetic."""
    first = lin // (group * num_n_blocks) * group  # the group's first pair
    size = cutlass.min(group, pairs - first)
    r = lin - first * num_n_blocks
    n_block = r // size
    pair = first + r - n_block * size
    batch = pair // num_kv_heads
    return n_block, pair - batch * num_kv_heads, batch


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
        operations are ordered after that read (bar.warp.sync).  Turn 0 does not read."""
        if turn > 0:
            if cute.arch.lane_idx() == 0:
                addr = self.address(off)
                seen = ld_acquire_gpu_s32(addr)
                while seen < turn:
                    nanosleep(SPIN_SLEEP_NS)
                    seen = ld_acquire_gpu_s32(addr)
            cute.arch.sync_warp()

    @cute.jit
    def peek(self, off, turn):
        """The early read of ``DQ_RELAY_PREFETCH``: lane 0 issues an acquire read of the counter at ``off`` and
        returns it without waiting for it (the value is first used at the adds, ``wait_seen``); other lanes, turn 0
        and ``off`` < 0 (a tile past the workspace) get ``turn``, which lets them through."""
        seen = turn
        if turn > 0:
            if cute.arch.lane_idx() == 0:
                if off >= 0:
                    seen = ld_acquire_gpu_s32(self.address(off))
        return seen

    @cute.jit
    def wait_seen(self, off, turn, seen):
        """``wait`` after ``peek``: lane 0 re-reads (acquire) only while the value it holds is below ``turn``.  Its
        early read is program-ordered before the adds, so when that read already saw the turn the adds are ordered
        after the previous CTA's release exactly as when the read is made here."""
        if turn > 0:
            if cute.arch.lane_idx() == 0:
                if seen < turn:  # the early read was too early: read again at once, then poll
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
            red_release_gpu_add_s32(self.address(off), 1)
