"""Dropout on the CPU: the Philox4x32 emulation (known-answer vectors, exact uint32 arithmetic), the statistics of
the keep mask (keep rate, independence of neighbours, tiles, heads, batches and calls), its reproducibility, and
the argument checks that must raise before any launch."""

import math

import pytest
import torch

from flash_attn_4_sm120 import arguments, config, config_bwd, dropout, interface, jit, plan as P
from scripts import gate_lists as GL

# Random123 known-answer vectors for Philox4x32-10 (kat_vectors): counter, key -> output
KAT_10 = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_int(c, k, rounds):
    """Philox4x32 with Python ints (the textbook definition, independent of the torch emulation)."""
    c0, c1, c2, c3 = c
    k0, k1 = k
    m = 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & m, p1 & m, ((p0 >> 32) ^ c3 ^ k1) & m, p0 & m
    return c0, c1, c2, c3


@pytest.mark.parametrize("ctr,key,expected", KAT_10)
def test_philox_known_answers(ctr, key, expected):
    got = tuple(int(x) for x in dropout.philox4x32(*ctr, *key, rounds=10))
    assert got == expected
    assert _philox_int(ctr, key, 10) == expected


def test_philox7_emulation_matches_python_ints():
    g = torch.Generator().manual_seed(0)
    vals = torch.randint(0, 1 << 32, (6, 2000), generator=g, dtype=torch.int64)
    out = dropout.philox4x32(*vals, rounds=dropout.PHILOX_ROUNDS)
    for n in range(0, 2000, 97):
        want = _philox_int(tuple(int(x) for x in vals[:4, n]), tuple(int(x) for x in vals[4:, n]), 7)
        assert tuple(int(o[n]) for o in out) == want
    assert dropout.PHILOX_ROUNDS == 7


def test_words_follow_the_stated_counter_layout():
    seed, offset = 0x1234_5678_9ABC_DEF0, 0x0000_0003_0000_0008
    w = dropout.random_words(seed, offset, 2, 3, 40, 40, batch_start=1)
    cases = [(0, 0, 0, 0), (1, 2, 4, 39), (0, 1, 3, 9), (1, 0, 2, 17), (0, 2, 1, 24), (1, 1, 8, 0), (0, 0, 15, 33),
             (1, 2, 23, 8), (0, 1, 39, 31), (1, 0, 16, 1)]
    for b, h, i, j in cases:
        group = (j // 16) * 4 + (j % 8) // 2
        pair = (i // 16) * 8 + i % 8
        word = 2 * ((j // 8) % 2) + j % 2
        half = (i // 8) % 2
        ctr = (((b + 1) << 16) | h, pair, offset & 0xFFFFFFFF, group)
        key = (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32))
        low_bits = (1 << dropout.KEEP_BITS) - 1
        assert int(w[b, h, i, j]) == (_philox_int(ctr, key, 7)[word] >> (16 * half)) & low_bits
    assert int(w.max()) < 1 << dropout.KEEP_BITS


def test_one_call_decides_the_2x4_block_of_a_thread_and_no_value_is_reused():
    """The 8 elements (i0, i0 + 8) x (j0, j0 + 1, j0 + 8, j0 + 9) of an m16n8k16 thread share one Philox call,
    and every element of a tile takes a distinct (call, word, half): the 128 bits of each call are used once."""
    w = dropout.random_words(99, 4, 1, 1, 32, 32)
    seen = {}
    for i in range(32):
        for j in range(32):
            call = ((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8)
            slot = (2 * ((j // 8) % 2) + j % 2, (i // 8) % 2)
            assert (call, slot) not in seen
            seen[(call, slot)] = (i, j)
    calls = {c for c, _ in seen}
    assert len(calls) == 32 * 32 // 8 and all(sum(1 for c, _ in seen if c == cc) == 8 for cc in calls)
    g, t = 3, 1  # thread lane 4 g + t of a 16x16 block: rows g, g + 8; columns 2t, 2t + 1, 2t + 8, 2t + 9
    block = {(i, j) for i in (g, g + 8) for j in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)}
    assert {seen[k] for k in seen if k[0] == ((2 * t) // 2, g)} == block
    assert w.shape == (1, 1, 32, 32)


@pytest.fixture(scope="module")
def words_10m():
    # 2 x 4 x 1250 x 1000 = 10M elements, one (seed, offset)
    return dropout.random_words(20240917, 8, 2, 4, 1250, 1000)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_4_sigma(words_10m, p):
    keep = words_10m >= dropout.keep_threshold(p)
    n = keep.numel()
    assert n >= 10_000_000
    rate = keep.double().mean().item()
    q = dropout.expected_keep_rate(p)
    assert abs(q - (1 - p)) <= 2.0 ** -(dropout.KEEP_BITS + 1)  # p quantised to a multiple of 2**-KEEP_BITS
    sigma = math.sqrt(q * (1 - q) / n)
    assert abs(rate - q) <= 4 * sigma, f"keep rate {rate:.6f} vs {q:.6f} (4 sigma = {4 * sigma:.2e})"


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("what", ["col+1", "col+8", "col+9", "col+16", "row+1", "row+8", "tile_n+64", "tile_m+128",
                                  "head", "batch"])
def test_neighbours_are_uncorrelated(words_10m, what):
    """Correlation of keep indicators (p = 0.5) between neighbours; a reused counter or word gives |r| ~ 1."""
    keep = words_10m >= dropout.keep_threshold(0.5)
    pairs = {
        "col+1": (keep[..., :-1], keep[..., 1:]),
        "col+8": (keep[..., :-8], keep[..., 8:]),  # the same Philox call, another word
        "row+8": (keep[:, :, :-8], keep[:, :, 8:]),  # the same Philox call, the other half of the word
        "col+9": (keep[..., :-9], keep[..., 9:]),
        "col+16": (keep[..., :-16], keep[..., 16:]),  # the next group of the same row
        "row+1": (keep[:, :, :-1], keep[:, :, 1:]),
        "tile_n+64": (keep[..., :-64], keep[..., 64:]),
        "tile_m+128": (keep[:, :, :-128], keep[:, :, 128:]),
        "head": (keep[:, :-1], keep[:, 1:]),
        "batch": (keep[0], keep[1]),
    }
    a, b = pairs[what]
    r = _corr(a, b)
    assert abs(r) < 4 / math.sqrt(a.numel()), f"{what}: correlation {r:.2e}"


def test_words_are_uniform(words_10m):
    """Chi-square of the top 8 bits of the KEEP_BITS-bit values over 256 bins (df = 255: mean 255, sd ~22.6; 400 is
    > 6 sd), and of the low byte."""
    top = dropout.KEEP_BITS - 8
    for byte in (words_10m >> top, words_10m & 0xFF):
        assert int(byte.max()) < 256
        counts = torch.bincount(byte.flatten(), minlength=256).double()
        exp = words_10m.numel() / 256
        chi2 = ((counts - exp) ** 2 / exp).sum().item()
        assert chi2 < 400, chi2


def test_same_seed_same_mask_and_different_seed_or_offset_differs():
    m = dropout.dropout_mask(7, 12, 0.5, 2, 3, 67, 131)
    assert torch.equal(m, dropout.dropout_mask(7, 12, 0.5, 2, 3, 67, 131))
    for seed, offset in [(8, 12), (7, 16), (7 + (1 << 32), 12), (7, 12 + (1 << 32))]:
        other = dropout.dropout_mask(seed, offset, 0.5, 2, 3, 67, 131)
        frac = (other != m).double().mean().item()
        assert 0.45 < frac < 0.55, (seed, offset, frac)


def test_mask_is_a_function_of_positions_only():
    """A sub-block (other batch_start, fewer rows/columns) is the same slice of the full mask."""
    full = dropout.dropout_mask(3, 4, 0.3, 4, 2, 50, 70)
    part = dropout.dropout_mask(3, 4, 0.3, 2, 2, 20, 33, batch_start=2)
    assert torch.equal(part, full[2:4, :, :20, :33])


def test_mask_p_edges():
    assert dropout.dropout_mask(1, 0, 0.0, 1, 1, 3, 5).all()
    assert not dropout.dropout_mask(1, 0, 1.0, 1, 1, 3, 5).any()
    assert dropout.keep_threshold(0.5) == 1 << (dropout.KEEP_BITS - 1)
    assert dropout.keep_threshold(1 - 1e-12) == 1 << dropout.KEEP_BITS  # keeps none
    assert dropout.keep_threshold(1e-9) == 0  # keeps all


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.1", None, True, torch.tensor(0.1)])
def test_bad_dropout_p_raises(bad):
    with pytest.raises(ValueError, match="dropout_p"):
        dropout.check_p(bad)
    q = torch.zeros(1, 4, 1, 64)  # CPU: the dropout check comes first, before any tensor check
    with pytest.raises(ValueError, match="dropout_p"):
        interface.flash_attn_func(q, q, q, dropout_p=bad)


def test_bad_seed_raises():
    dev = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="dropout_seed"):
        dropout.check_seed(1.5, None, dev)
    with pytest.raises(ValueError, match="dropout_seed"):
        dropout.check_seed("7", None, dev)
    with pytest.raises(ValueError, match="64 bits"):
        dropout.check_seed(1 << 64, None, dev)
    with pytest.raises(ValueError, match="int64"):
        dropout.check_seed(torch.tensor([1], dtype=torch.int32), None, dev)
    with pytest.raises(ValueError, match="one int64 value"):
        dropout.check_seed(torch.tensor([1, 2]), None, dev)
    with pytest.raises(ValueError, match="q's device"):
        dropout.check_seed(torch.tensor([1]), None, dev)  # a CPU tensor
    with pytest.raises(ValueError, match="dropout_offset needs dropout_seed"):
        dropout.check_seed(None, 4, dev)
    with pytest.raises(ValueError, match="dropout_offset"):
        dropout.check_seed(1, -(1 << 64), dev)
    assert dropout.check_seed(-1, None, dev) == ((1 << 64) - 1, None, 0)


def test_capture_without_seed_tensor_raises():
    with pytest.raises(ValueError, match="CUDA graph"):
        dropout.resolve(0.1, None, None, torch.device("cuda", 0), capturing=True)


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel compile or launch fails the test: the refusals must come before."""
    from flash_attn_4_sm120 import dispatch, dispatch_bwd

    def boom(*a, **k):
        raise AssertionError("a kernel was compiled or launched")

    for mod in (dispatch, dispatch_bwd):
        monkeypatch.setattr(mod, "_kernel", boom)
        monkeypatch.setattr(mod, "_launch", boom)


@pytest.mark.parametrize("num_splits", [2, 0, -1, 256])
def test_dropout_with_split_kv_raises_before_launch(no_launch, num_splits):
    """dropout x split-KV: num_splits != 1 (automatic included) with dropout_p > 0 raises ValueError naming both,
    from the public functions (compat.check_call, before any routing: autograd, the torch.library op)."""
    q = torch.zeros(1, 4, 1, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    calls = (
        lambda: interface.flash_attn_func(q, q, q, dropout_p=0.1, num_splits=num_splits),
        lambda: interface.flash_attn_varlen_func(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4,
                                                 max_seqlen_k=4, dropout_p=0.1,
                                                 num_splits=num_splits),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"dropout_p=0\.1 with num_splits=.*split-KV"):
            call()


def test_dropout_with_block_sparse_raises_before_launch(no_launch):
    """dropout x block sparsity raises ValueError naming both, before the block-sparse tensors are even read."""
    q = torch.zeros(1, 4, 1, 64)
    bst = object()  # never inspected: the refusal comes first
    for call in (lambda: interface.flash_attn_func(q, q, q, dropout_p=0.5, block_sparse_tensors=bst),
                 lambda: _compat(p=0.5, sparse=True)):
        with pytest.raises(ValueError, match=r"dropout_p=0\.5 with block_sparse_tensors.*block sparsity"):
            call()


def test_split_or_sparse_without_dropout_is_not_refused_by_dropout():
    """p = 0 with split-KV / block sparsity reaches their own checks, not the dropout refusal."""
    with pytest.raises(ValueError, match="block_sparse_tensors is not supported"):  # split x sparse, not dropout
        _compat(num_splits=2, sparse=True)
    _compat(p=0.3)  # no error
    with pytest.raises(ValueError, match="num_splits=0"):
        _compat(p=0.3, dropout_p=0.3, num_splits=0)

def _compat(**kw):
    """compat.check_call of an inference call on CPU with every feature off but ``kw``."""
    from flash_attn_4_sm120 import compat

    args = dict(p=0.0, num_splits=1, sparse=False, sparse_bwd=False, paged=False, cu_seqlens_k=False,
                pack_gqa=None, needs_grad=False, compiling=False, mods=False, score_mod=False, softcap=0.0,
                q=None, v=None)
    args.update(kw)
    args.setdefault("dropout_p", args["p"])
    return compat.check_call(**args)



def test_dropout_with_paged_kv_raises():
    """Paged K/V is inference-only: dropout with a page table raises before any tensor check or launch."""
    q = torch.zeros(1, 4, 1, 64)
    pages = torch.zeros(1, 1, dtype=torch.int32)
    for call in (interface.flash_attn_func, interface.flash_attn_varlen_func):
        with pytest.raises(ValueError, match="paged K/V"):
            call(q, q, q, dropout_p=0.1, page_table=pages)


def test_kernel_params_are_int32_bit_patterns():
    a = dropout.DropoutArgs(0.5, (0xFFFFFFFE << 32) | 0x80000001, (5 << 32) | 0xFFFFFFFC)
    v = a.kernel_params()
    assert isinstance(v, arguments.DropoutParams)
    assert v.threshold == 1 << (dropout.KEEP_BITS - 1)
    assert v.seed_lo == -(1 << 31) + 1 and v.seed_hi == -2
    assert v.offset_lo == -4 and v.offset_hi == 5
    assert v.scale == 2.0 and v.seed is None
    seed_t = torch.zeros(1, dtype=torch.int64)
    assert dropout.DropoutArgs(0.25, 0, 7, seed_t).kernel_params().seed is seed_t


def test_dropout_arguments_only_when_compiled_with_dropout():
    """One ``dropout`` record per kernel (arguments.DropoutParams), present only in the kernels compiled with
    dropout; its seed tensor only when compiled to read the seed from the device."""
    names = arguments.DropoutParams._fields
    for rec in (arguments.FWD_ARGS, arguments.BWD_DKDV_ARGS, arguments.BWD_DQ_ARGS):
        by_name = {a.name: a for a in rec.args}
        arg = by_name["dropout"]
        assert (arg.kind, arg.when, arg.record) == ("record", "has_dropout", arguments.DropoutParams)
        assert tuple(f.name for f in arg.fields) == names
        assert {f.name: f.when for f in arg.fields}["seed"] == "dropout_seed_tensor"
        assert not any(n.startswith(("rng_", "dropout_")) for n in rec.names)
    pytest.importorskip("cutlass")
    base = config.FwdKernelConfig("bf16", 128, 128, config.select_fwd_tile(128, 128, False))
    for cfg, present, seed in ((base, False, False), (config.replace(base, has_dropout=True), True, False),
                               (config.replace(base, has_dropout=True, dropout_seed_tensor=True), True, True)):
        fakes = dict(zip(arguments.FWD_ARGS.names, jit.fake_args(arguments.FWD_ARGS, cfg)))
        if not present:
            assert fakes["dropout"] is None
            continue
        rec = fakes["dropout"]
        assert isinstance(rec, arguments.DropoutParams)
        assert all(getattr(rec, n) is not None for n in names[:-1])
        assert (rec.seed is not None) == seed


def test_column_groups_cover_each_column_once():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120.kernels.philox import column_groups

    fwd_cols = [0, 1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57]
    groups = column_groups(fwd_cols, True)
    assert all(kind == "quad" for kind, _, _ in groups) and len(groups) == 4
    assert sorted(c for _, _, cs in groups for c in cs) == list(range(16))
    wide = [0, 1, 16, 17, 32, 33, 48, 49]  # a warp split along N: no whole group per thread
    groups = column_groups(wide, True)
    assert all(kind == "pair" for kind, _, _ in groups) and len(groups) == 4
    assert all(kind == "pair" for kind, _, _ in column_groups(fwd_cols, False))


def test_row_pairs_match_the_m16_rows_of_a_thread():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120.kernels.philox import row_pairs

    assert row_pairs([0, 8]) == [(0, 1)]
    assert row_pairs([0, 8, 16, 24]) == [(0, 1), (2, 3)]  # two m16 atoms per warp
    assert row_pairs([0, 8, 64, 72]) == [(0, 1), (2, 3)]  # atoms 64 rows apart (warps stacked along M)
    assert row_pairs([0, 16]) is None and row_pairs([8, 16]) is None and row_pairs([0]) is None


@pytest.mark.parametrize("wm,wn,tile_m,tile_n", [(8, 1, 128, 64), (4, 2, 64, 64), (2, 4, 32, 64), (4, 1, 64, 32),
                                                 (8, 1, 256, 64)])
def test_thread_fragments_read_the_contract(wm, wn, tile_m, tile_n):
    """A CPU mirror of Dropout.bits (kernels/score_dropout.py) on m16n8k16 accumulator fragments (warps wm x wn; lane 4 g + t
    holds rows g, g + 8 and columns 2t, 2t + 1 of each 16 x 8 atom): grouping columns with ``column_groups`` and
    rows with ``row_pairs`` (thread 0's offsets, as the kernels do), one Philox call per (row pair, group), low
    halves for the first row and high halves for the second (their low KEEP_BITS bits), reproduces
    ``random_words`` for every element of
    the tile, whichever warp layout (quads when warps are stacked along M, pairs otherwise)."""
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120.kernels.philox import column_groups, row_pairs

    seed, offset, b, h, m_block, n_block = 0xABCDEF0123, 0x5_0000_0010, 1, 2, 1, 3
    ref = dropout.random_words(seed, offset, b + 1, h + 1, (m_block + 1) * tile_m, (n_block + 1) * tile_n)[b, h]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32)
    quad_ok = wn == 1
    got = torch.full((tile_m, tile_n), -1, dtype=torch.int64)
    for warp in range(wm * wn):
        w_m, w_n = warp % wm, warp // wm
        for lane in range(32):
            g, t = lane // 4, lane % 4
            rows = [a * 16 * wm + w_m * 16 + g + e for a in range(tile_m // (16 * wm)) for e in (0, 8)]
            cols = [a * 8 * wn + w_n * 8 + 2 * t + e for a in range(tile_n // (8 * wn)) for e in (0, 1)]
            t0_rows = [r - rows[0] for r in rows]
            t0_cols = [c - cols[0] for c in cols]
            for ra, rb in row_pairs(t0_rows):
                qa = m_block * tile_m + rows[ra]
                for kind, c0, cs in column_groups(t0_cols, quad_ok):
                    col = n_block * tile_n + cols[0] + c0
                    ctr = ((b << 16) | h, (qa // 16) * 8 + qa % 8, offset & 0xFFFFFFFF,
                           (col // 16) * 4 + (col % 8) // 2)
                    w = _philox_int(ctr, (k0, k1), 7)
                    mine = w if kind == "quad" else ((w[2], w[3]) if col & 8 else (w[0], w[1]))
                    mask = (1 << dropout.KEEP_BITS) - 1
                    for e, c in enumerate(cs):
                        got[rows[ra], cols[c]] = mine[e] & mask
                        got[rows[rb], cols[c]] = (mine[e] >> 16) & mask
    want = ref[m_block * tile_m:(m_block + 1) * tile_m, n_block * tile_n:(n_block + 1) * tile_n]
    assert (got >= 0).all() and torch.equal(got, want)


@pytest.mark.parametrize("flag,tag,windowed", [("dropout_packed", "_dpack", False), ("dropout_high_p", "_dhi", True)])
def test_dropout_forward_variants_keep_the_tile(flag, tag, windowed):
    """The forward variants of dropout run the tile of the plain dropout forward and the compile gate builds them
    for every forward dropout tile: ``dropout_packed`` (packed GQA rows: a thread's rows g, g + 8 are not positions
    i, i + 8 of one head, so the keep bits are made row by row; the dispatcher's choice whenever pack > 1) and
    ``dropout_high_p`` (p > 0.96875: the complement keep test)."""
    args = ("bf16", 128, 128, windowed, False, False, False, False, False, False, False, 0)
    plain = P.get_plan(P.PlanKey(*args, dropout=True)).fwd_cfg
    variant = P.get_plan(P.PlanKey(*args, dropout=True, **{flag: True})).fwd_cfg
    assert not getattr(plain, flag) and getattr(variant, flag) and variant.tile == plain.tile
    assert tag in variant.name() and tag not in plain.name()
    fwd = [c for c in GL.dropout_gate_worklist() if isinstance(c, config.FwdKernelConfig)]
    assert {c.tile for c in fwd if getattr(c, flag)} == {c.tile for c in fwd}


def test_high_p_threshold():
    """The forward's direct keep test compares the 15-bit values as fp16 numbers, exact for thresholds up to 0x7C00
    (+inf; p <= 0.96875); above, the forward tests the complement (``DropoutArgs.high_p``)."""
    assert dropout.keep_threshold(0.96875) == dropout.F16_DIRECT_MAX_THRESHOLD == 0x7C00
    assert not dropout.DropoutArgs(0.96875, 1, 0).high_p
    assert dropout.DropoutArgs(0.97, 1, 0).high_p and dropout.DropoutArgs(1 - 2.0 ** -17, 1, 0).high_p
    assert dropout.keep_threshold(1 - 2.0 ** -17) == 1 << dropout.KEEP_BITS  # keeps none: the complement's 0
