"""The fused backward's relay form (``deterministic=True``) on the host (CPU): which calls take it, the turn
counters' workspace, and the relay's schedule, played out by a small simulator of the grid (launch order, limited
residency, any interleaving) to check that it orders every query tile's adds by key tile and never deadlocks."""

import random

import pytest
import torch

from flash_attn_4_sm120 import arguments, config_bwd, dispatch_bwd
from flash_attn_4_sm120.config import WINDOW_UNBOUNDED
from flash_attn_4_sm120.kernels.dq_relay import first_key_tile
from test_block_sparse_bwd import recorded_launches  # noqa: F401  (fixture)


# ---- configuration and routing -------------------------------------------------------------------------------
@pytest.mark.parametrize("d,windowed,flags", [(64, False, {}), (64, True, {"has_dropout": True}), (96, True, {}),
                                              (128, False, {}), (128, True, {}), (128, True, {"has_dropout": True}),
                                              (128, False, {"varlen_q": True, "varlen_k": True, "has_softcap": True})])
def test_relay_keeps_the_fused_tile(wide_relay, d, windowed, flags):
    pair = config_bwd.select_bwd_config("bf16", d, d, windowed=windowed, **flags)
    fused, cvt = config_bwd.fused_for(pair)
    relay, rcvt = config_bwd.fused_for(pair, relay=True)
    assert relay.dq_relay and not fused.dq_relay and relay.fused_dq
    assert (relay.tile_m, relay.tile_n, relay.num_warps) == (fused.tile_m, fused.tile_n, fused.num_warps)
    assert rcvt == cvt  # the convert kernel reads the same workspace
    assert relay.name() != fused.name()  # its own compile key and cache entry
    assert not config_bwd.bwd_problems(relay)


@pytest.mark.parametrize("d,windowed", [(64, False), (64, True), (96, False), (96, True), (128, False),
                                        (128, True)])
def test_relay_only_where_it_beat_the_pair(d, windowed):
    # config_bwd.RELAY_HEAD_DIMS: d64 relay (relay_bwd_h200_s35.jsonl), d128 relay since the one-loop walk with the
    # heads inner (relay_hi_*_h100_s40.jsonl), d96 pair (benchmarks/experiments/results/)
    pair = config_bwd.select_bwd_config("bf16", d, d, windowed=windowed)
    assert config_bwd.fused_for(pair) is not None  # the default is fused at every one of them
    relay = config_bwd.fused_for(pair, relay=True)
    assert (relay is not None) is (d in config_bwd.RELAY_HEAD_DIMS) is (d in (64, 128))


@pytest.mark.parametrize("d", [32, 192, 256])
def test_no_relay_where_no_fused_tile(d):
    assert config_bwd.fused_for(config_bwd.select_bwd_config("bf16", d, d), relay=True) is None


def test_relay_with_mods_on_the_plain_d128_tile_runs_the_pair(wide_relay):
    # its relay form spilled there (config_bwd._BWD_SPILLING "relay_mods"); the windowed 64x64 tile keeps it
    from flash_attn_4_sm120 import modspec

    mods = modspec.recipe_placeholder("causal", (), (), False)
    plain = config_bwd.select_bwd_config("bf16", 128, 128, mods=mods)
    assert config_bwd.fused_for(plain) is not None and config_bwd.fused_for(plain, relay=True) is None
    win = config_bwd.select_bwd_config("bf16", 128, 128, windowed=True, mods=mods)
    relay, _ = config_bwd.fused_for(win, relay=True)
    assert relay.dq_relay and (relay.tile_m, relay.tile_n) == (64, 64)


def test_relay_needs_the_fused_kernel():
    cfg = config_bwd.BwdKernelConfig("bf16", 64, 64, 64, 128, 8, dq_relay=True)
    assert any("dq_relay" in p for p in config_bwd.bwd_problems(cfg))


def test_turns_argument_follows_the_workspace():
    names = arguments.BWD_DKDV_ARGS.names
    assert names.index("dq_turns") == names.index("dq_accum") + 1
    (arg,) = [a for a in arguments.BWD_DKDV_ARGS.args if a.name == "dq_turns"]
    assert (arg.kind, arg.rank, arg.when) == ("i32nd", 2, "dq_relay")


@pytest.mark.parametrize("tile_m,d,batch,rows,hq,varlen", [(64, 64, 2, 113, 4, False), (32, 128, 1, 1, 1, False),
                                                            (64, 96, 5, 1000, 7, True), (64, 128, 3, 77, 3, True)])
def test_workspace_and_counters_share_one_zeroed_allocation(tile_m, d, batch, rows, hq, varlen):
    cfg = config_bwd.BwdKernelConfig("bf16", d, d, tile_m, 64, 8, fused_dq=True)
    accum, turns = dispatch_bwd.dq_workspace(cfg, batch, rows, hq, varlen, torch.device("cpu"))
    assert turns is None and accum.shape == (config_bwd.dq_accum_blocks(tile_m, batch, rows, varlen), hq, tile_m * d)
    relay = config_bwd.BwdKernelConfig("bf16", d, d, tile_m, 64, 8, fused_dq=True, dq_relay=True)
    accum, turns = dispatch_bwd.dq_workspace(relay, batch, rows, hq, varlen, torch.device("cpu"))
    blocks = config_bwd.dq_accum_blocks(tile_m, batch, rows, varlen)
    assert accum.shape == (blocks, hq, tile_m * d) and accum.dtype == torch.float32 and accum.is_contiguous()
    assert turns.shape == (blocks, hq) and turns.dtype == torch.int32 and turns.is_contiguous()
    assert accum.untyped_storage().data_ptr() == turns.untyped_storage().data_ptr()  # one allocation
    assert turns.data_ptr() % 16 == 0 and turns.data_ptr() >= accum.data_ptr() + accum.numel() * 4  # no overlap
    assert not accum.any() and not turns.any()


def test_deterministic_takes_the_relay(recorded_launches):  # noqa: F811
    import flash_attn_4_sm120 as fa

    q = torch.randn(2, 100, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 150, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    for det in (False, True):
        recorded_launches.clear()
        out = fa.flash_attn_func(q, k, k, causal=True, deterministic=det)[0]
        torch.autograd.grad(out, (q, k), torch.ones_like(out))
        recs = [rec for _, rec, _ in recorded_launches]
        assert recs == [arguments.FWD_ARGS, arguments.BWD_PRE_ARGS, arguments.BWD_DKDV_ARGS,
                        arguments.DQ_CONVERT_ARGS]
        cfg, _, vals = recorded_launches[2]
        assert cfg.fused_dq and cfg.dq_relay is det and (vals["dq_turns"] is not None) is det
        if det:  # zeroed, one counter per workspace tile and query head, beside the workspace
            assert vals["dq_turns"].shape == vals["dq_accum"].shape[:2] and not vals["dq_turns"].any()
        assert recorded_launches[3][2]["dq_accum"] is vals["dq_accum"]


def test_deterministic_keeps_the_pair_without_a_fused_tile(recorded_launches):  # noqa: F811
    import flash_attn_4_sm120 as fa

    for d, sink in ((192, None), (64, torch.zeros(2))):
        recorded_launches.clear()
        q = torch.randn(1, 64, 2, d, dtype=torch.bfloat16, requires_grad=True)
        out = fa.flash_attn_func(q, q, q, deterministic=True, learnable_sink=sink)[0]
        torch.autograd.grad(out, (q,), torch.ones_like(out))
        assert [rec for _, rec, _ in recorded_launches][2:] == [arguments.BWD_DKDV_ARGS, arguments.BWD_DQ_ARGS]
        assert recorded_launches[2][2]["dq_turns"] is None and not recorded_launches[2][0].fused_dq


# ---- the schedule ----------------------------------------------------------------------------------------------
def _q_range(n, tm, tn, windowed, sq, sk, left, right):
    """kernels/block_info.py BlockInfo.q_range, transcribed (pack 1)."""
    m_max, m_min = -(-sq // tm), 0
    if windowed:
        diag = sk - sq
        m_min = max(n * tn - diag - right, 0) // tm
        m_max = min(m_max, max((n + 1) * tn - 1 - diag + left + tm, 0) // tm)
    return m_min, m_max


def test_first_key_tile_starts_the_run_of_contributors():
    rng = random.Random(0)
    for _ in range(3000):
        tm, tn = rng.choice([(64, 128), (64, 64), (32, 128)])
        sq, sk = rng.randint(0, 700), rng.randint(1, 700)
        windowed = rng.random() < 0.8
        left = rng.choice([WINDOW_UNBOUNDED, 0, 1, 17, 64, 200])
        right = rng.choice([0, 0, 1, 16, 300, WINDOW_UNBOUNDED])
        nk = -(-sk // tn)
        for m in range(-(-sq // tm)):
            contrib = [n for n in range(nk) if _q_range(n, tm, tn, windowed, sq, sk, left, right)[0] <= m
                       < _q_range(n, tm, tn, windowed, sq, sk, left, right)[1]]
            if contrib:  # one run of key tiles, starting at first_key_tile
                assert contrib == list(range(contrib[0], contrib[-1] + 1))
                assert contrib[0] == first_key_tile(m, tm, tn, windowed, sq, sk, left), (tm, tn, sq, sk, left, m)
            else:  # no contributor: whatever first_key_tile says, nobody waits on it
                assert all(not (_q_range(n, tm, tn, windowed, sq, sk, left, right)[0] <= m
                                < _q_range(n, tm, tn, windowed, sq, sk, left, right)[1]) for n in range(nk))


class Deadlock(Exception):
    pass


def _simulate(lens_q, lens_k, cu_q, hq, hkv, tm, tn, windowed, left, right, slots, lpt, seed, ascending=True,
              at_least=True, heads_inner=False):
    """Play the relay out: CTAs dispatched in linear-index order into ``slots`` residency slots, resident CTAs
    stepping in a random interleaving; a CTA's next add waits until its tile's counter reaches its turn.  Returns
    {(tile, head): [key tiles in the order they added]}; raises Deadlock when no CTA can move."""
    rng = random.Random(seed)
    batch = len(lens_q)
    gx, gy, gz = max(-(-max(lens_k) // tn), 1), hkv, batch
    use_lpt = lpt and windowed and gx >= 16 and gy * gz <= 64  # kernels/bwd_dkdv.py cta_coords
    ctas = []
    for lin in range(gx * gy * gz):
        if use_lpt:
            n, rest = divmod(lin, gy * gz)
            b, h = divmod(rest, gy)
        else:
            n, rest = lin % gx, lin // gx
            h, b = rest % gy, rest // gy
        sq, sk = lens_q[b], lens_k[b]
        walk = []
        if n * tn < sk:
            m_min, m_max = _q_range(n, tm, tn, windowed, sq, sk, left, right)
            heads = range(h * (hq // hkv), (h + 1) * (hq // hkv))
            tiles = list(reversed(range(m_min, max(m_max, m_min))))  # descending (bwd_dkdv dense_entry)
            order = ([(head, m) for m in tiles for head in heads] if heads_inner  # config_bwd.RELAY_HEADS_INNER
                     else [(head, m) for head in heads for m in tiles])
            for head, m in order:
                blk = cu_q[b] // tm + b + m if cu_q is not None else b * -(-max(lens_q) // tm) + m
                first = first_key_tile(m, tm, tn, windowed, sq, sk, left)
                if ascending:
                    turn = n - first
                else:  # the last contributor first
                    last = max(j for j in range(-(-sk // tn)) if _q_range(j, tm, tn, windowed, sq, sk, left,
                                                                           right)[0] <= m
                               < _q_range(j, tm, tn, windowed, sq, sk, left, right)[1])
                    turn = last - n
                walk.append(((blk, head), turn, n))
        ctas.append(walk)
    counters, order = {}, {}
    nxt, resident = 0, []
    while nxt < len(ctas) or resident:
        while nxt < len(ctas) and len(resident) < slots:
            resident.append([nxt, 0])
            nxt += 1
        moved = False
        rng.shuffle(resident)
        for cta in list(resident):
            walk = ctas[cta[0]]
            steps = rng.randint(1, 3)
            while steps and cta[1] < len(walk):
                key, turn, n = walk[cta[1]]
                c = counters.get(key, 0)
                if not (c >= turn if at_least else c == turn):
                    break
                counters[key] = c + 1
                order.setdefault(key, []).append(n)
                cta[1] += 1
                steps -= 1
                moved = True
            if cta[1] == len(walk):
                resident.remove(cta)
                moved = True
        if not moved:
            raise Deadlock(f"{len(resident)} resident CTAs wait, {len(ctas) - nxt} not launched")
    return order


_CASES = [  # (lens_q, lens_k, varlen, hq, hkv, tile, windowed, left, right)
    ([300, 300], [500, 500], False, 4, 2, (64, 128), False, WINDOW_UNBOUNDED, WINDOW_UNBOUNDED),
    ([1024], [1024], False, 2, 1, (64, 64), True, WINDOW_UNBOUNDED, 0),  # causal, LPT launch order
    ([700, 700], [2100, 2100], False, 2, 2, (32, 128), True, WINDOW_UNBOUNDED, 0),  # causal, Sk > Sq
    ([900], [400], False, 3, 1, (64, 128), True, WINDOW_UNBOUNDED, 0),  # causal, rows that see no key
    ([1500], [1500], False, 2, 2, (64, 64), True, 100, 30),  # sliding window
    ([0, 17, 113, 1, 0, 64], [5, 17, 200, 0, 3, 64], True, 4, 2, (64, 128), True, WINDOW_UNBOUNDED, 0),  # varlen
    ([0, 17, 113, 1, 0, 64], [5, 17, 200, 0, 3, 64], True, 7, 1, (32, 128), False, WINDOW_UNBOUNDED,
     WINDOW_UNBOUNDED),
]


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("slots", [1, 3, 64])
def test_relay_orders_every_tile_by_key_tile_and_never_deadlocks(case, slots):
    lens_q, lens_k, varlen, hq, hkv, (tm, tn), windowed, left, right = _CASES[case]
    cu_q = _cu(lens_q) if varlen else None
    runs = [_simulate(lens_q, lens_k, cu_q, hq, hkv, tm, tn, windowed, left, right, slots, lpt, seed)
            for lpt in (False, True) for seed in range(3)]
    assert runs[0]  # some tile had adds
    for order in runs:
        assert order == runs[0]  # the same order whatever the interleaving and launch order
        for adds in order.values():
            assert adds == sorted(adds) and len(set(adds)) == len(adds)


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_relay_with_heads_inner_orders_the_same_and_never_deadlocks(case):
    # config_bwd.RELAY_HEADS_INNER: query tiles outer, a GQA group's heads inner; every tile's adds still come in
    # key-tile order, the same order as with heads outer
    lens_q, lens_k, varlen, hq, hkv, (tm, tn), windowed, left, right = _CASES[case]
    cu_q = _cu(lens_q) if varlen else None
    outer = _simulate(lens_q, lens_k, cu_q, hq, hkv, tm, tn, windowed, left, right, 3, False, 0)
    for slots in (1, 3, 64):
        for lpt in (False, True):
            inner = _simulate(lens_q, lens_k, cu_q, hq, hkv, tm, tn, windowed, left, right, slots, lpt, slots,
                              heads_inner=True)
            assert inner == outer


def test_the_simulator_finds_the_deadlock_of_the_launch_inverted_order():
    # waiting for higher key tiles (launched later) deadlocks once the grid does not fit: the check can fail
    lens_q, lens_k, varlen, hq, hkv, (tm, tn), windowed, left, right = _CASES[1]
    with pytest.raises(Deadlock):
        _simulate(lens_q, lens_k, None, hq, hkv, tm, tn, windowed, left, right, 2, True, 0, ascending=False)
    _simulate(lens_q, lens_k, None, hq, hkv, tm, tn, windowed, left, right, 2, True, 0)


def test_lying_metadata_that_shares_tiles_cannot_hang():
    # cu_seqlens_q going back makes two sequences use the same workspace tiles (kernels clamp, never trust it):
    # waiting for "counter == turn" can hang there, "counter >= turn" (the kernel's) lets every CTA through
    lens_q, lens_k = [1000, 0, 1000], [1000, 1000, 1000]
    cu_q = [0, 1000, 0, 1000]
    tm, tn = 64, 64
    _simulate(lens_q, lens_k, cu_q, 2, 1, tm, tn, False, WINDOW_UNBOUNDED, WINDOW_UNBOUNDED, 4, False, 0)
    hung = 0
    for seed in range(5):
        try:
            _simulate(lens_q, lens_k, cu_q, 2, 1, tm, tn, False, WINDOW_UNBOUNDED, WINDOW_UNBOUNDED, 4, False,
                      seed, at_least=False)
        except Deadlock:
            hung += 1
    assert hung  # the exact-turn variant hangs on this metadata: the check above is not vacuous
