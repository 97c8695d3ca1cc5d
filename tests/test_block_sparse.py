"""Block sparsity on the CPU: the builders' semantics (against dense boolean masks and against torch's own
flex_attention), the host checks (each bad input raises before any launch), the compile key and the records."""

import math
import warnings

import pytest
import torch

from flash_attn_4_sm120 import BlockSparseTensors, block_sparse_from_flex, block_sparse_from_mask
from flash_attn_4_sm120 import block_sparse as BS
from flash_attn_4_sm120 import arguments, config, modspec, plan as P
from scripts import gate_lists as GL
from reference import attention_ref, sparse_allowed


def _block_mask(b, h, nq, nk, density, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, h, nq, nk, generator=g) < density
    m[..., 0, :] = False  # one query block row with no KV block at all
    return m


def test_from_mask_lists_exactly_the_true_blocks_packed_left():
    m = _block_mask(2, 3, 5, 7, 0.4, 0)
    full = m & _block_mask(2, 3, 5, 7, 0.5, 1)
    bst = block_sparse_from_mask(m, (64, 128), full_mask=full)
    assert bst.block_size == (64, 128)
    for t in bst[:4]:
        assert t.dtype == torch.int32
    assert torch.equal(bst.mask_block_cnt, (m & ~full).sum(-1).int())
    assert torch.equal(bst.full_block_cnt, full.sum(-1).int())
    for cnt, idx, want in ((bst.mask_block_cnt, bst.mask_block_idx, m & ~full),
                           (bst.full_block_cnt, bst.full_block_idx, full)):
        for b, h, qb in [(0, 0, 1), (1, 2, 4), (1, 1, 0), (0, 2, 3)]:
            c = int(cnt[b, h, qb])
            listed = idx[b, h, qb, :c].tolist()
            assert listed == sorted(listed), "ascending, packed left"
            assert listed == want[b, h, qb].nonzero().flatten().tolist()


def test_dense_expansion_round_trip_with_partial_last_blocks():
    m = _block_mask(1, 2, 3, 4, 0.5, 2)
    bst = block_sparse_from_mask(m, (32, 16))
    sq, sk = 3 * 32 - 5, 4 * 16 - 3  # partial last blocks
    visited, full = BS.dense_mask_from_block_sparse(bst, sq, sk)
    want = m.repeat_interleave(32, 2).repeat_interleave(16, 3)[:, :, :sq, :sk]
    assert torch.equal(visited, want) and not full.any()


def test_dense_expansion_clamps_lying_metadata_like_the_kernel():
    cnt = torch.tensor([[[9, -3]]], dtype=torch.int32)  # count above the width, negative count
    idx = torch.tensor([[[[1, 99], [0, 0]]]], dtype=torch.int32)  # index past the end: an empty block
    visited, _ = BS.dense_mask_from_block_sparse(BlockSparseTensors(cnt, idx, block_size=(16, 16)), 32, 48)
    assert visited[0, 0, :16, 16:32].all() and visited[0, 0, :16].sum() == 16 * 16
    assert not visited[0, 0, 16:].any()


def _flex():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    return fa.create_block_mask, fa.flex_attention


def _sparse_ref(q, k, v, bst, causal=False, window=(None, None)):
    """fp32 reference of a block-sparse call: visited blocks, with causal/window applied to mask blocks only."""
    sq, sk = q.shape[1], k.shape[1]
    visited, full = BS.dense_mask_from_block_sparse(bst, sq, sk)
    return attention_ref(q, k, v, mask=sparse_allowed(visited, full, sq, sk, causal, window))


@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
def test_flex_block_mask_semantics_match_flex_attention_on_cpu(kind):
    create_block_mask, flex_attention = _flex()
    s, h, d = 300, 2, 32
    if kind == "causal":
        def mod(b, hh, qi, kv):
            return qi >= kv
        kw = dict(causal=True)
    elif kind == "window":
        def mod(b, hh, qi, kv):
            return (qi >= kv) & (qi - kv <= 100)
        kw = dict(window=(100, 0))
    else:  # documents aligned to the 128-key blocks: no partial block, the mask_mod is carried by the list alone
        doc = torch.arange(s) // 128

        def mod(b, hh, qi, kv):
            return doc[qi] == doc[kv]
        kw = {}
    bm = create_block_mask(mod, 1, 1, s, s, device="cpu", BLOCK_SIZE=(128, 128))
    bst = block_sparse_from_flex(bm)
    assert bst.block_size == (128, 128) and bst.mask_block_cnt.dtype == torch.int32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm)
    ref, _ = _sparse_ref(q, k, v, bst, **kw)
    assert (ref - want.transpose(1, 2)).abs().max().item() < 1e-4


def test_block_size_must_be_a_multiple_of_the_tile():
    tile = config.select_sparse_tile(128, 128, False)
    assert BS.block_size_ratios((2 * tile.tile_m, 3 * tile.tile_n), 128, 128, False) == (2, 3)
    with pytest.raises(ValueError, match=rf"\({tile.tile_m}, {tile.tile_n}\)"):
        BS.block_size_ratios((tile.tile_m // 2, tile.tile_n), 128, 128, False)
    with pytest.raises(ValueError, match="kv_block"):
        BS.block_size_ratios((tile.tile_m, tile.tile_n + 16), 128, 128, False)
    for bad in [(128,), (0, 128), (128.0, 128), "128"]:
        with pytest.raises(ValueError, match="block_size"):
            BS.block_size_ratios(bad, 128, 128, False)


def _good(b=2, h=4, nq=3, width=5, full=True):
    z3 = torch.zeros(b, h, nq, dtype=torch.int32)
    z4 = torch.zeros(b, h, nq, width, dtype=torch.int32)
    return BlockSparseTensors(z3, z4, z3.clone() if full else None, z4.clone() if full else None, (128, 128))


def _check(bst, **kw):
    args = dict(batch=2, heads=4, max_q=3 * 128, max_k=5 * 128, head_dim=64, head_dim_v=64, windowed=False,
                device=torch.device("cpu"))
    args.update(kw)
    return BS.check_block_sparse(bst, **args)


def test_check_accepts_good_and_broadcast_inputs():
    (qr, kr), tensors = _check(_good())
    tile = config.select_sparse_tile(64, 64, False)
    assert (qr, kr) == (128 // tile.tile_m, 128 // tile.tile_n)
    assert len(tensors) == 4
    _check(_good(b=1, h=1))  # broadcast B and H
    _, tensors = _check(_good(full=False))  # no full blocks: empty stand-ins
    assert tensors[2].shape == (1, 1, 1) and int(tensors[2].sum()) == 0
    # a strided index view is made contiguous (the kernel takes the last dim contiguous)
    g = _good()
    strided = torch.zeros(2, 4, 3, 10, dtype=torch.int32)[..., ::2]
    _, tensors = _check(g._replace(mask_block_idx=strided))
    assert tensors[1].stride(-1) == 1


@pytest.mark.parametrize("case,needle", [
    ("dtype", "int32"), ("rank", "dims"), ("batch", "batch extent"), ("heads", "head extent"),
    ("qblocks", "query blocks"), ("idx_shape", "first three dims"), ("half_full", "together"),
    ("type", "BlockSparseTensors"), ("device", "on meta"),
])
def test_check_rejects(case, needle):
    g = _good()
    bad = {
        "dtype": lambda: g._replace(mask_block_cnt=g.mask_block_cnt.long()),
        "rank": lambda: g._replace(mask_block_idx=g.mask_block_idx[..., 0]),
        "batch": lambda: _good(b=3),
        "heads": lambda: _good(h=2),
        "qblocks": lambda: _good(nq=2),
        "idx_shape": lambda: g._replace(mask_block_idx=torch.zeros(2, 4, 2, 5, dtype=torch.int32)),
        "half_full": lambda: g._replace(full_block_idx=None),
        "type": lambda: (g.mask_block_cnt, g.mask_block_idx),
        "device": lambda: g._replace(mask_block_cnt=g.mask_block_cnt.to("meta")),
    }[case]()
    with pytest.raises(ValueError, match=needle):
        _check(bad)


def test_debug_checks_name_lying_counts_and_indices():
    g = _good()
    cnt = g.mask_block_cnt.clone()
    cnt[1, 2, 0] = 6  # width is 5
    with pytest.raises(ValueError, match=r"mask_block_cnt\[1, 2, 0\]=6 is outside \[0, 5\]"):
        _check(g._replace(mask_block_cnt=cnt), debug=True)
    _check(g._replace(mask_block_cnt=cnt))  # without debug checks: not read on the host (the kernel clamps)
    idx = g.full_block_idx.clone()
    cnt = g.full_block_cnt.clone()
    cnt[0, 0, 2] = 2
    idx[0, 0, 2, 1] = 5  # 5 KV blocks: 0..4
    with pytest.raises(ValueError, match=r"full_block_idx\[0, 0, 2, 1\]=5 is outside \[0, 5\)"):
        _check(g._replace(full_block_cnt=cnt, full_block_idx=idx), debug=True)


def test_refused_combinations():
    with pytest.raises(NotImplementedError, match="page_table"):
        _compat(sparse=True, paged=True)
    with pytest.raises(ValueError, match="pack_gqa"):
        _compat(sparse=True, pack_gqa=True)
    _compat(sparse=True, pack_gqa=False)
    _compat(sparse=True, pack_gqa=None)

def _compat(**kw):
    """compat.check_call of an inference call on CPU with every feature off but ``kw``."""
    from flash_attn_4_sm120 import compat

    args = dict(p=0.0, num_splits=1, sparse=False, sparse_bwd=False, paged=False, cu_seqlens_k=False,
                pack_gqa=None, needs_grad=False, compiling=False, mods=False, score_mod=False, softcap=0.0,
                q=None, v=None)
    args.update(kw)
    args.setdefault("dropout_p", args["p"])
    return compat.check_call(**args)



def test_from_mask_rejects_bad_masks():
    m = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="bool"):
        block_sparse_from_mask(m.int(), (128, 128))
    with pytest.raises(ValueError, match="bool"):
        block_sparse_from_mask(m[0], (128, 128))
    with pytest.raises(ValueError, match="full_mask"):
        block_sparse_from_mask(m, (128, 128), full_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_from_mask(m, (128, 0))
    with pytest.raises(ValueError, match="BlockMask"):
        block_sparse_from_flex(object())


def test_sparse_fake_args_are_one_record():
    """The compile path builds the block lists as one BlockSparseLists of int32 tensors (counts rank 3, indices rank
    4, last dim contiguous) for a block-sparse configuration, and None for a dense one."""
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit

    sparse = config.FwdKernelConfig("bf16", 128, 128, config.select_sparse_tile(128, 128, False),
                                    sparse_q_ratio=1, sparse_kv_ratio=1)
    dense = config.FwdKernelConfig("bf16", 128, 128, config.select_fwd_tile(128, 128, False))
    for cfg in (sparse, dense):
        fakes = dict(zip(arguments.FWD_ARGS.names, jit.fake_args(arguments.FWD_ARGS, cfg)))
        rec = fakes["sparse"]
        if not cfg.block_sparse:
            assert rec is None
            continue
        assert isinstance(rec, arguments.BlockSparseLists)
        assert [len(t.shape) for t in rec] == [3, 4, 3, 4]
        assert all(t.stride[-1] == 1 and str(t.element_type) == "Int32" for t in rec)


def test_checked_lists_are_the_kernels_record():
    """check_block_sparse hands the kernels one BlockSparseLists, with the empty full lists when none were given."""
    cnt = torch.zeros(1, 1, 2, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 3, dtype=torch.int32)
    _, lists = BS.check_block_sparse(BlockSparseTensors(cnt, idx), batch=1, heads=1, max_q=256, max_k=384,
                                     head_dim=128, head_dim_v=128, windowed=False, device=torch.device("cpu"))
    assert isinstance(lists, arguments.BlockSparseLists)
    assert lists.mask_block_cnt is cnt and lists.mask_block_idx is idx
    assert lists.full_block_cnt.shape == (1, 1, 1) and lists.full_block_idx.shape == (1, 1, 1, 1)
    assert isinstance(BS.transpose_block_sparse(lists, 3), arguments.BlockSparseLists)


def test_sparse_compile_key_and_records():
    cfg = config.FwdKernelConfig("bf16", 128, 128, config.select_sparse_tile(128, 128, False),
                                 sparse_q_ratio=2, sparse_kv_ratio=1)
    assert cfg.block_sparse and "sparse2x1" in cfg.name() and cfg.tile.tma
    assert not config.FwdKernelConfig("bf16", 128, 128, cfg.tile).block_sparse
    (arg,) = [a for a in arguments.FWD_ARGS.args if a.name == "sparse"]
    assert (arg.kind, arg.when, arg.record) == ("record", "block_sparse", arguments.BlockSparseLists)
    assert tuple(f.name for f in arg.fields) == ("mask_block_cnt", "mask_block_idx", "full_block_cnt",
                                                 "full_block_idx")
    assert [f.rank for f in arg.fields] == [3, 4, 3, 4]
    gated = GL.sparse_gate_worklist()
    for c in gated:
        assert c.block_sparse and c.tile in config.reachable_sparse_tiles(c.head_dim, c.head_dim_v, c.windowed)
    # every tile a block size can select is gated (TMA and cp.async), at some head_dim_v
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            for t in config.reachable_sparse_tiles(d, dv, windowed):
                assert any(c.head_dim == d and c.tile == t for c in gated), (d, dv, t)
    assert {c.tile.tma for c in gated} == {True, False}
    # the plan of a sparse call runs the sparse tile and carries the ratios in its compile key
    plan = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, False, False, False, False, False, False, 0, False, sparse=(2, 1)))
    assert plan.fwd_cfg.sparse_q_ratio == 2 and plan.fwd_cfg.tile == config.select_sparse_tile(128, 128, False)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_sparse_tile_shape_keeps_block_sizes(d):
    """The sparse forward runs the TMA kernel where it fits (d <= 192; at d192 for block sizes its 64 keys divide);
    the block sizes valid before (multiples of the cp.async tiles sparse calls ran: 128 query rows; 128 keys at
    d <= 64, 64 at d96/d128, 32 at d192) stay valid, with or without causal and with or without mods."""
    before = {32: (128, 128), 64: (128, 128), 96: (128, 64), 128: (128, 64), 192: (128, 32), 256: (64, 32)}[d]
    for windowed in (False, True):
        for mods in (False, True):
            tile = config.select_sparse_tile(d, d, windowed, mods, block_size=(128, 128))
            assert tile.tma == (d <= 192)
            finest = config.select_sparse_tile(d, d, windowed, mods, block_size=before)
            assert (finest.tile_m, finest.tile_n) == before
            for t in (tile, finest):
                assert not config.fwd_tile_problems(d, d, t)
        for mult in (1, 2, 3):
            blk = (before[0], before[1] * mult)
            tile = config.select_sparse_tile(d, d, windowed, block_size=blk)
            assert BS.block_size_ratios(blk, d, d, windowed) == (blk[0] // tile.tile_m, blk[1] // tile.tile_n)
        # the finest tile bounds the valid block sizes (and the error names it)
        with pytest.raises(ValueError, match=rf"\({before[0]}, {before[1]}\)"):
            BS.block_size_ratios((before[0], before[1] + 16), d, d, windowed)
    # the DEFAULT_BLOCK_SIZE is a multiple of every sparse tile
    tile = config.select_sparse_tile(d, d, False)
    assert BS.block_size_ratios(None, d, d, False) == (128 // tile.tile_m, 128 // tile.tile_n)


def test_d192_block_size_picks_the_plan_tile():
    """d192: kv_block a multiple of 64 runs the TMA tile, an odd multiple of 32 the cp.async 128x32 tile; the plan
    (keyed by the block size) and the host ratios agree."""
    for blk, tma, ratios in (((128, 128), True, (1, 2)), ((128, 96), False, (1, 3)), ((256, 64), True, (2, 1))):
        assert BS.block_size_ratios(blk, 192, 192, True) == ratios
        plan = P.get_plan(P.PlanKey("bf16", 192, 192, True, False, False, False, False, False, False, False, 0, False,
                              sparse=(*ratios, *blk)))
        tile = plan.fwd_cfg.tile
        assert tile.tma == tma and (blk[0] // tile.tile_m, blk[1] // tile.tile_n) == ratios
        assert (plan.fwd_cfg.sparse_q_ratio, plan.fwd_cfg.sparse_kv_ratio) == ratios
    # with a mod the TMA tile reads Q from shared memory (same shape)
    plan = P.get_plan(P.PlanKey("bf16", 64, 64, True, False, False, False, False, False, False, False, 0, False,
                          sparse=(1, 1, 128, 128), mods=modspec.recipe_placeholder("causal", (), (), False)))
    assert plan.fwd_cfg.tile.tma and not plan.fwd_cfg.tile.q_in_regs


def test_public_api_refuses_before_any_launch():
    import flash_attn_4_sm120 as fa
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    bst = block_sparse_from_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool), (128, 128))
    # the backward lists without the forward's
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd"):
        fa.flash_attn_func(q, q, q, block_sparse_tensors_bwd=bst)
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd"):
        fa.flash_attn_varlen_func(q, q, q, block_sparse_tensors_bwd=bst)
    # a grad-requiring call is accepted now: on a CPU tensor it fails at the device check, not as "not implemented"
    with pytest.raises(ValueError, match="CUDA|cuda"):
        fa.flash_attn_func(q, q, q, block_sparse_tensors=bst)
    assert math.isfinite(0.0)
