"""Split-KV block schedule (kernels/block_info.py: SplitBlockInfo) run on a GPU through a probe kernel: the splits
of a query tile visit exactly the KV blocks of the unsplit plan, each once, every block but a split's first with
the masks of its unsplit phase, and a split's first block with every mask (a superset).  Empty splits visit
nothing.  (CPU: tests/test_split_schedule.py traces and compiles the probe for sm_120a.)"""

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

import cutlass  # noqa: E402
from cutlass import Int32  # noqa: E402

from flash_attn_4_sm120.kernels.block_info import BlockInfo, SplitBlockInfo  # noqa: E402
from flash_attn_4_sm120.kernels.seqlen_info import SeqInfo  # noqa: E402

TILE_M, TILE_N = 128, 64
UNBOUNDED = 1 << 29


class _Probe:
    """Writes (n_min, n_max, count_a, count_b, count_c) of split ``blockIdx.x``, query tile ``blockIdx.y``."""

    def __init__(self, windowed: bool, unsplit: bool = False):
        self.windowed = windowed
        self.unsplit = unsplit  # the base BlockInfo (the reference plan)

    @cute.jit
    def __call__(self, res: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, left: Int32, right: Int32,
                 num_splits: Int32, stream):
        self.kernel(res, seqlen_q, seqlen_k, left, right, num_splits).launch(
            grid=(num_splits, res.shape[1], 1), block=(1, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, res: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, left: Int32, right: Int32,
               num_splits: Int32):
        split, m_block, _ = cute.arch.block_idx()
        seq = SeqInfo(Int32(0), Int32(0), Int32(0), seqlen_q, seqlen_k, False, False)
        if cutlass.const_expr(self.unsplit):
            info = BlockInfo(TILE_M, TILE_N, self.windowed, seq, left, right, Int32(1))
        else:
            info = SplitBlockInfo(TILE_M, TILE_N, self.windowed, seq, left, right, Int32(1), split, num_splits)
        plan = info.kv_plan(m_block)
        for i in cutlass.range_constexpr(5):
            res[split, m_block, i] = plan[i]


def _compile(windowed: bool, unsplit: bool = False):
    fake = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), cute.sym_int(), 5),
                                         stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return cute.compile(_Probe(windowed, unsplit), fake, Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def _visits(plan, windowed):
    """Blocks visited by a plan, in order, with their (seqlen, right, left) masks (run_kv_schedule's walk)."""
    n_min, n_max, ca, cb, cc = plan
    if n_max <= n_min:
        return []
    first = n_max - 1
    out = [(first, (True, windowed, windowed))]
    out += [(first - 1 - i, (False, True, True)) for i in range(ca if windowed else 0)]
    start_b = first - ca
    out += [(start_b - 1 - i, (False, False, False)) for i in range(cb)]
    start_c = start_b - cb
    out += [(start_c - 1 - i, (False, False, True)) for i in range(cc if windowed else 0)]
    return out


CASES = [  # seqlen_q, seqlen_k, left, right (None: unbounded)
    (1, 4127, None, None), (1, 64, None, None), (5, 1000, None, 0), (300, 5000, None, 0), (700, 700, 100, 0),
    (128, 8192, 1000, 50), (1, 30000, 4096, 0), (257, 3, None, None), (1, 0, None, None),
]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_splits", [2, 3, 7, 64])
@pytest.mark.parametrize("sq,sk,left,right", CASES)
def test_splits_partition_the_unsplit_plan(num_splits, sq, sk, left, right):
    windowed = left is not None or right is not None
    fn, fn_unsplit = _compile(windowed), _compile(windowed, unsplit=True)
    m_blocks = -(-sq // TILE_M)
    lo, ro = UNBOUNDED if left is None else left, UNBOUNDED if right is None else right

    def run(f, n):
        res = torch.full((n, m_blocks, 5), -7, dtype=torch.int32, device="cuda")
        f(res, sq, sk, lo, ro, n)
        torch.cuda.synchronize()
        return res.cpu().tolist()

    whole = run(fn_unsplit, 1)
    one = run(fn, 1)
    assert all(_visits(one[0][m], windowed) == _visits(whole[0][m], windowed) for m in range(m_blocks)), \
        "one split visits what the unsplit plan visits"
    split = run(fn, num_splits)
    for m in range(m_blocks):
        ref = dict(_visits(whole[0][m], windowed))
        assert len(ref) == len(_visits(whole[0][m], windowed))
        seen = {}
        for s in range(num_splits):
            visits = _visits(split[s][m], windowed)
            for i, (n, masks) in enumerate(visits):
                assert n not in seen, f"block {n} visited by splits {seen.get(n)} and {s}"
                seen[n] = s
                assert n in ref, f"split {s} visits block {n}, outside the unsplit plan"
                if i == 0:
                    assert masks == (True, windowed, windowed)
                else:
                    assert masks == ref[n], f"block {n}: masks {masks}, unsplit phase {ref[n]}"
            ns = [n for n, _ in visits]
            assert ns == sorted(ns, reverse=True) and (not ns or ns[0] - ns[-1] == len(ns) - 1)
        assert set(seen) == set(ref), f"tile {m}: blocks {sorted(set(ref) - set(seen))} never visited"
        # splits take consecutive runs in order: split s's blocks all lie above split s-1's
        owners = [seen[n] for n in sorted(seen)]
        assert owners == sorted(owners)
