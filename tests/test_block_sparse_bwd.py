"""Block-sparse backward on the CPU: the device-side transpose of the forward's lists (torch ops, run here on CPU
tensors) against a plain-Python reference, the block-size rules of a call that needs grad, the checks of
``block_sparse_tensors_bwd`` (each bad input raises before any launch), the compile keys and the records."""

import pytest
import torch

from flash_attn_4_sm120 import BlockSparseTensors, block_sparse_from_mask
from flash_attn_4_sm120 import block_sparse as BS
from flash_attn_4_sm120 import arguments, config, config_bwd, dispatch, dispatch_bwd, plan as P
from scripts import gate_lists as GL


def _transpose_ref(cnt, idx, num_kv_blocks):
    """Per (b, h, kv block): the sorted query blocks that list it, with the kernels' clamping (count to
    [0, width], index to [0, num_kv_blocks], where num_kv_blocks itself lists nothing)."""
    b, h, nq = cnt.shape
    width = idx.shape[-1]
    out = {}
    for bi in range(b):
        for hi in range(h):
            lists = [set() for _ in range(num_kv_blocks)]
            for qb in range(nq):
                c = min(max(int(cnt[bi, hi, qb]), 0), width)
                for j in range(c):
                    kb = min(max(int(idx[bi, hi, qb, j]), 0), num_kv_blocks)
                    if kb < num_kv_blocks:
                        lists[kb].add(qb)
            out[bi, hi] = [sorted(s) for s in lists]
    return out


def _as_lists(cnt, idx):
    b, h, nk = cnt.shape
    return {(bi, hi): [idx[bi, hi, kb, :int(cnt[bi, hi, kb])].tolist() for kb in range(nk)]
            for bi in range(b) for hi in range(h)}


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 4, 4), (1, 4, 6, 3), (2, 1, 1, 9)])
@pytest.mark.parametrize("seed", [0, 1])
def test_transpose_matches_python_reference(shape, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, nq, nk = shape
    m = torch.rand(b, h, nq, nk, generator=g) < 0.4
    full = m & (torch.rand(b, h, nq, nk, generator=g) < 0.5)
    m[..., 0, :] = False  # a query block with no KV block
    full[..., 0, :] = False
    bst = block_sparse_from_mask(m, (128, 128), full_mask=full)
    tensors = (bst.mask_block_cnt, bst.mask_block_idx, bst.full_block_cnt, bst.full_block_idx)
    out = BS.transpose_block_sparse(tensors, nk)
    assert len(out) == 4
    for t in out:
        assert t.dtype == torch.int32 and t.is_contiguous()
    mc, mi, fc, fi = out
    assert mc.shape == (b, h, nk) and mi.shape == (b, h, nk, nq)
    assert _as_lists(mc, mi) == _transpose_ref(*tensors[:2], nk)
    assert _as_lists(fc, fi) == _transpose_ref(*tensors[2:], nk)
    # the transposed mask blocks are the (kv, q) pairs of the forward's mask blocks, exactly
    partial = (m & ~full).transpose(-1, -2)
    for bi in range(b):
        for hi in range(h):
            for kb in range(nk):
                assert _as_lists(mc, mi)[bi, hi][kb] == partial[bi, hi, kb].nonzero().flatten().tolist()
    # transposing twice gives the forward's lists back (same count per query block, same sets)
    back = BS.transpose_block_sparse(out, nq)
    assert torch.equal(back[0], bst.mask_block_cnt) and torch.equal(back[2], bst.full_block_cnt)
    assert _as_lists(back[0], back[1]) == _as_lists(bst.mask_block_cnt, bst.mask_block_idx)


def test_transpose_clamps_lying_counts_and_indices_like_the_kernel():
    cnt = torch.tensor([[[9, -3, 2]]], dtype=torch.int32)  # width 3: 9 -> 3, -3 -> 0
    idx = torch.tensor([[[[0, 7, -5], [1, 1, 1], [2, 1 << 30, 1]]]], dtype=torch.int32)
    z3 = torch.zeros(1, 1, 1, dtype=torch.int32)
    z4 = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    mc, mi, fc, fi = BS.transpose_block_sparse((cnt, idx, z3, z4), 3)
    # q block 0 lists 0, 7 (clamped to 3: nothing), -5 (clamped to 0); q block 2 lists 2 and 1<<30 (nothing)
    assert _as_lists(mc, mi) == {(0, 0): [[0], [], [2]]}
    assert _as_lists(mc, mi) == _transpose_ref(cnt, idx, 3)
    assert fc.shape == (1, 1, 3) and int(fc.sum()) == 0  # the "no full blocks" stand-in transposes to nothing


def test_transpose_of_broadcast_and_strided_inputs():
    m = torch.rand(1, 1, 3, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    bst = block_sparse_from_mask(m, (128, 128))
    wide = torch.zeros(1, 1, 3, 8, dtype=torch.int32)
    wide[..., ::2] = bst.mask_block_idx
    tensors = (bst.mask_block_cnt, wide[..., ::2], torch.zeros(1, 1, 1, dtype=torch.int32),
               torch.zeros(1, 1, 1, 1, dtype=torch.int32))
    mc, mi, _, _ = BS.transpose_block_sparse(tensors, 4)
    assert mc.shape == (1, 1, 4)
    assert _as_lists(mc, mi) == _transpose_ref(bst.mask_block_cnt, bst.mask_block_idx, 4)


def test_transpose_is_deterministic():
    m = torch.rand(2, 2, 9, 11, generator=torch.Generator().manual_seed(4)) < 0.5
    bst = block_sparse_from_mask(m, (128, 128))
    t = (bst.mask_block_cnt, bst.mask_block_idx, bst.mask_block_cnt, bst.mask_block_idx)
    a, b = BS.transpose_block_sparse(t, 11), BS.transpose_block_sparse(t, 11)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- block sizes and checks of a call that needs grad -------------------------------------------------------------
def _tiles(d):
    fwd = config.sparse_tiles(d, d, False)[-1]  # the finest forward tile: its multiples are the valid block sizes
    dkdv = config_bwd.select_bwd_config("bf16", d, d)
    dq = config_bwd.select_dq_config("bf16", d, d)
    return fwd, dkdv, dq


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_grad_block_multiples_are_multiples_of_every_tile(d):
    fwd, dkdv, dq = _tiles(d)
    mult = BS.grad_block_multiples(d, d, False)
    for q, k in (mult["forward"], mult["auto"]):
        assert q % fwd.tile_m == 0 and q % dq.tile_m == 0 and k % fwd.tile_n == 0 and k % dq.tile_n == 0
    q, k = mult["auto"]
    assert q % dkdv.tile_m == 0 and k % dkdv.tile_n == 0
    assert mult["backward"] == (dkdv.tile_m, dkdv.tile_n)
    # the default block size works everywhere
    assert 128 % q == 0 and 128 % k == 0


def _prepare(bst, bst_bwd=None, d=128, max_q=3 * 128, max_k=5 * 128, debug=False, windowed=False):
    args = dict(batch=2, heads=4, max_q=max_q, max_k=max_k, head_dim=d, head_dim_v=d, windowed=windowed,
                device=torch.device("cpu"))
    _, fwd = BS.check_block_sparse(bst, **args)
    return BS.prepare_backward(bst, bst_bwd, fwd, **args, debug=debug)


def _fwd(b=2, h=4, nq=3, width=5, block_size=(128, 128)):
    z3 = torch.zeros(b, h, nq, dtype=torch.int32)
    z4 = torch.zeros(b, h, nq, width, dtype=torch.int32)
    return BlockSparseTensors(z3, z4, z3.clone(), z4.clone(), block_size)


def _bwd(b=2, h=4, nk=5, width=3, block_size=(128, 128), full=True):
    z3 = torch.zeros(b, h, nk, dtype=torch.int32)
    z4 = torch.zeros(b, h, nk, width, dtype=torch.int32)
    return BlockSparseTensors(z3, z4, z3.clone() if full else None, z4.clone() if full else None, block_size)


def test_prepare_backward_ratios_auto_and_given():
    _, dkdv, dq = _tiles(128)
    sg = _prepare(_fwd())
    assert sg.bwd_tensors is None and sg.num_kv_blocks == 5
    assert sg.dq_ratios == (128 // dq.tile_m, 128 // dq.tile_n)
    assert sg.dkdv_ratios == (128 // dkdv.tile_m, 128 // dkdv.tile_n)
    bwd = sg.backward_tensors()  # built from the forward's lists
    assert bwd[0].shape == (2, 4, 5) and bwd[1].shape == (2, 4, 5, 3)
    # given KV-major lists, with their own block size (a multiple of the dK/dV tile)
    bs = (dkdv.tile_m, 2 * dkdv.tile_n)
    sg = _prepare(_fwd(), _bwd(nk=-(-5 * 128 // bs[1]), block_size=bs))
    assert sg.dkdv_ratios == (1, 2)
    assert sg.backward_tensors() is sg.bwd_tensors
    sg = _prepare(_fwd(), _bwd(b=1, h=1, full=False))  # broadcast, no full blocks
    assert sg.bwd_tensors[2].shape == (1, 1, 1)


def test_prepare_backward_rejects_block_sizes_the_backward_cannot_honour():
    # d=192: forward tile 128x32, dQ 64x64, dK/dV 32x64: kv_block 32 runs the forward but not the backward
    fwd, dkdv, dq = _tiles(192)
    assert fwd.tile_n == 32 and dq.tile_n == 64
    bst = _fwd(width=20, block_size=(128, 32))
    with pytest.raises(ValueError, match=r"kv_block a multiple of 64"):
        _prepare(bst, d=192)
    # the KV-major lists' block size must be a multiple of the dK/dV tile
    dkdv = config_bwd.select_bwd_config("bf16", 128, 128)
    with pytest.raises(ValueError, match=r"block_sparse_tensors_bwd: block_size=\(16, 128\).*multiple of "
                                         rf"{dkdv.tile_m}"):
        _prepare(_fwd(), _bwd(block_size=(16, 128)))
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd: block_size must be a pair"):
        _prepare(_fwd(), _bwd(block_size=(128, 0)))


@pytest.mark.parametrize("case,needle", [
    ("dtype", "int32"), ("rank", "dims"), ("batch", "batch extent"), ("heads", "head extent"),
    ("rows", "KV blocks"), ("idx_shape", "first three dims"), ("half_full", "together"),
    ("type", "BlockSparseTensors"), ("device", "on meta"),
])
def test_bwd_tensors_rejected_before_launch(case, needle):
    g = _bwd()
    bad = {
        "dtype": lambda: g._replace(mask_block_cnt=g.mask_block_cnt.long()),
        "rank": lambda: g._replace(mask_block_idx=g.mask_block_idx[..., 0]),
        "batch": lambda: _bwd(b=3),
        "heads": lambda: _bwd(h=2),
        "rows": lambda: _bwd(nk=4),  # 5 KV blocks of 128 keys are needed
        "idx_shape": lambda: g._replace(mask_block_idx=torch.zeros(2, 4, 4, 3, dtype=torch.int32)),
        "half_full": lambda: g._replace(full_block_idx=None),
        "type": lambda: (g.mask_block_cnt, g.mask_block_idx),
        "device": lambda: g._replace(mask_block_cnt=g.mask_block_cnt.to("meta")),
    }[case]()
    with pytest.raises(ValueError, match=f"block_sparse_tensors_bwd: .*{needle}"):
        _prepare(_fwd(), bad)


def test_bwd_debug_checks_name_lying_values():
    g = _bwd()
    cnt = g.mask_block_cnt.clone()
    cnt[1, 3, 4] = 4  # width 3
    with pytest.raises(ValueError, match=r"mask_block_cnt\[1, 3, 4\]=4 is outside \[0, 3\]"):
        _prepare(_fwd(), g._replace(mask_block_cnt=cnt), debug=True)
    _prepare(_fwd(), g._replace(mask_block_cnt=cnt))  # not read on the host without debug checks
    cnt = g.full_block_cnt.clone()
    idx = g.full_block_idx.clone()
    cnt[0, 0, 0] = 1
    idx[0, 0, 0, 0] = 3  # 3 query blocks: 0..2
    with pytest.raises(ValueError, match=r"full_block_idx\[0, 0, 0, 0\]=3 is outside \[0, 3\) \(the query blocks"):
        _prepare(_fwd(), g._replace(full_block_cnt=cnt, full_block_idx=idx), debug=True)


# ---- compile keys, records, plans -------------------------------------------------------------------------------
def test_sparse_backward_configs_records_and_plan():
    for rec in (arguments.BWD_DKDV_ARGS, arguments.BWD_DQ_ARGS):
        arg = next(a for a in rec.args if a.name == "sparse")
        assert (arg.kind, arg.when, arg.record) == ("record", "block_sparse", arguments.BlockSparseLists)
        assert tuple(f.name for f in arg.fields) == arguments.BlockSparseLists._fields
        assert not any(n.endswith(("_block_cnt", "_block_idx")) for n in rec.names)
    cfg = config_bwd.select_bwd_config("bf16", 128, 128, sparse_q_ratio=2, sparse_kv_ratio=1)
    assert cfg.block_sparse and cfg.name().endswith("sparse2x1")
    assert not config_bwd.select_bwd_config("bf16", 128, 128).block_sparse
    dq = config_bwd.select_dq_config("bf16", 128, 128, sparse_q_ratio=1, sparse_kv_ratio=2)
    assert dq.block_sparse and dq.name().startswith("dq") and "sparse1x2" in dq.name()
    work = GL.sparse_bwd_gate_worklist()
    assert 0 < len(work) <= 20 and all(c.block_sparse for c in work)
    assert {type(c) for c in work} == {config_bwd.BwdKernelConfig, config_bwd.DqKernelConfig}
    plan = P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, True, 0, False,
                          sparse=(1, 2), sparse_bwd=(1, 2, 2, 2)))
    assert plan.dq_cfg.sparse_q_ratio == 1 and plan.dq_cfg.sparse_kv_ratio == 2
    assert plan.bwd_cfg.sparse_q_ratio == 2 and plan.bwd_cfg.sparse_kv_ratio == 2
    assert plan.bwd_cfg.windowed and plan.fwd_cfg.sparse_q_ratio == 1
    # a dense plan's backward is not sparse
    plan = P.get_plan(P.PlanKey("bf16", 128, 128, False, False, False, False, False, False, False, True, 0, False))
    assert not plan.bwd_cfg.block_sparse and not plan.dq_cfg.block_sparse


def test_features_and_public_signature():
    import inspect

    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import features

    assert features.FEATURES["block_sparse_backward"].supported
    for fn in (fa.flash_attn_func, fa.flash_attn_varlen_func):
        p = inspect.signature(fn).parameters["block_sparse_tensors_bwd"]
        assert p.kind == p.KEYWORD_ONLY and p.default is None


@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
def test_transpose_equals_flex_q_side_tensors(kind):
    """torch's create_block_mask builds both orientations; our device-side transpose of its KV lists gives its
    q-side lists (the listed entries; the padding past the counts is unspecified)."""
    fx = pytest.importorskip("torch.nn.attention.flex_attention")
    s = 1000
    doc = (torch.arange(s) // 300).clamp(max=2)
    mods = {
        "causal": lambda b, h, qi, kv: qi >= kv,
        "window": lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 300),
        "documents": lambda b, h, qi, kv: doc[qi] == doc[kv],
    }
    bm = fx.create_block_mask(mods[kind], None, None, s, s, device="cpu", BLOCK_SIZE=(128, 128))
    fwd = BS.block_sparse_from_flex(bm)
    bwd = BS.block_sparse_bwd_from_flex(bm)
    t = BS.transpose_block_sparse(fwd[:4], -(-s // 128))
    assert torch.equal(t[0], bwd.mask_block_cnt) and torch.equal(t[2], bwd.full_block_cnt)
    assert _as_lists(t[0], t[1]) == _as_lists(bwd.mask_block_cnt, bwd.mask_block_idx)
    assert _as_lists(t[2], t[3]) == _as_lists(bwd.full_block_cnt, bwd.full_block_idx)
    with pytest.raises(ValueError, match="BlockMask"):
        BS.block_sparse_bwd_from_flex(object())


# ---- the host path end to end, kernels replaced by recorders --------------------------------------------------------
@pytest.fixture
def recorded_launches(monkeypatch):
    """Run the public API on CPU tensors with the device check relaxed and the compiled kernels replaced by
    recorders of (config, argument values): what each kernel would be launched with."""
    from flash_attn_4_sm120 import validate as V

    real_check = V.check_tensor

    def check_tensor(name, t, rank, device=None):
        if isinstance(t, torch.Tensor) and not t.is_cuda:
            # everything real_check verifies except the CUDA device
            if t.dim() != rank or t.dtype not in (torch.float16, torch.bfloat16) or t.stride(-1) != 1:
                real_check(name, t, rank, device)
            return
        real_check(name, t, rank, device)

    from flash_attn_4_sm120 import device as DV

    calls = []
    monkeypatch.setattr(V, "check_tensor", check_tensor)
    caps = DV.caps_from_properties("an SM120 card (test)", 12, 0, None, None, 188)
    for mod in (dispatch, dispatch_bwd):  # the forward and the backward path
        monkeypatch.setattr(mod, "device_caps", lambda dev: caps)
        monkeypatch.setattr(mod, "_kernel", lambda cfg, dev: cfg)
        monkeypatch.setattr(mod, "_launch", lambda fn, record, dev, values: calls.append((fn, record, values)))
    P.clear()
    dispatch_bwd.clear_caches()  # compiled kernels a stubbed compiler of another test may have left
    yield calls
    dispatch_bwd.clear_caches()
    P.clear()


@pytest.mark.parametrize("given", [False, True])
def test_autograd_passes_the_right_lists_to_each_kernel(recorded_launches, given):
    import flash_attn_4_sm120 as fa

    b, sq, sk, hq, hkv, d = 2, 300, 517, 4, 2, 128
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, requires_grad=True)
    bs = (128, 128)
    nq, nk = -(-sq // 128), -(-sk // 128)
    m = torch.rand(b, hq, nq, nk, generator=torch.Generator().manual_seed(5)) < 0.5
    bst = block_sparse_from_mask(m, bs)
    bwd = None
    if given:
        bwd = BlockSparseTensors(*BS.transpose_block_sparse(tuple(bst[:4])[:2] + (
            torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32)), nk), bs)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, block_sparse_tensors=bst, block_sparse_tensors_bwd=bwd,
                                  return_lse=True)
    assert out.requires_grad
    (fwd_cfg, rec, fwd_vals), = recorded_launches
    assert rec is arguments.FWD_ARGS and fwd_cfg.block_sparse
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    (_, _, _), (_, rec0, pre_vals), (dkdv_cfg, rec1, dkdv_vals), (dq_cfg, rec2, dq_vals) = recorded_launches
    assert rec0 is arguments.BWD_PRE_ARGS and rec1 is arguments.BWD_DKDV_ARGS and rec2 is arguments.BWD_DQ_ARGS
    assert pre_vals["dpsum"] is dkdv_vals["dpsum"] is dq_vals["dpsum"]  # the preprocess kernel writes D first
    assert pre_vals["out"].data_ptr() == out.data_ptr() and pre_vals["dlse"] is None
    tiles = _tiles(d)
    # ratios: the block size over each kernel's tile
    assert (dkdv_cfg.sparse_q_ratio, dkdv_cfg.sparse_kv_ratio) == (128 // tiles[1].tile_m, 128 // tiles[1].tile_n)
    assert (dq_cfg.sparse_q_ratio, dq_cfg.sparse_kv_ratio) == (128 // tiles[2].tile_m, 128 // tiles[2].tile_n)
    assert dkdv_cfg.windowed and dq_cfg.windowed
    # the dQ kernel gets the forward's lists (the very tensors), the dK/dV kernel the KV-major ones, each as one
    # arguments.BlockSparseLists
    fwd_lists, dq_lists, dkdv_lists = fwd_vals["sparse"], dq_vals["sparse"], dkdv_vals["sparse"]
    assert all(isinstance(x, arguments.BlockSparseLists) for x in (fwd_lists, dq_lists, dkdv_lists))
    assert all(x is y for x, y in zip(dq_lists, fwd_lists))
    expect = BS.transpose_block_sparse(fwd_lists, nk)
    for i, e in enumerate(expect):
        assert torch.equal(dkdv_lists[i], e)
        if given:
            assert dkdv_lists[i] is bwd[i]
    assert dkdv_vals["num_n_blocks"] == -(-sk // dkdv_cfg.tile_n)
    assert dq_vals["num_m_blocks"] == -(-sq // dq_cfg.tile_m)


def test_dense_backward_launches_carry_no_lists(recorded_launches):
    import flash_attn_4_sm120 as fa

    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    # the backward at d64 is the fused kernel (dK, dV, dQ into the fp32 workspace) and the dQ convert, with
    # deterministic=True in its relay form (tests/test_bwd_relay.py)
    for det, expect in ((False, [arguments.BWD_DKDV_ARGS, arguments.DQ_CONVERT_ARGS]),
                        (True, [arguments.BWD_DKDV_ARGS, arguments.DQ_CONVERT_ARGS])):
        recorded_launches.clear()
        out, _ = fa.flash_attn_func(q, q, q, return_lse=True, deterministic=det)
        torch.autograd.grad(out, (q,), torch.ones_like(out))
        assert [rec for _, rec, _ in recorded_launches] == [arguments.FWD_ARGS, arguments.BWD_PRE_ARGS, *expect]
        for cfg, rec, vals in recorded_launches:
            if rec in (arguments.BWD_PRE_ARGS, arguments.DQ_CONVERT_ARGS):  # no block lists
                continue
            assert not cfg.block_sparse
            assert vals["sparse"] is None
            if rec is arguments.BWD_DKDV_ARGS:
                assert cfg.fused_dq and vals["dq_accum"] is not None
                assert cfg.dq_relay is det and (vals["dq_turns"] is None) is (not det)


# ---- the kernels' schedules, emulated in PyTorch (design check: they visit exactly the right (query, key) pairs) ----
def _emulated_sparse_grads(q, k, v, dout, lse, dsum, fwd, bwd, block_size, bwd_block_size, tiles, windowed, allowed_win,
                           scale):
    """dQ as the dQ kernel walks the forward's lists (full tiles, then mask tiles), dK/dV as the dK/dV kernel walks
    the KV-major lists (heads of the group in order, mask then full blocks), each tile masked like the kernels
    (sequence end always, the window on mask tiles only), with their clamping."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    grp = hq // hkv
    (dq_m, dq_n), (kv_m, kv_n) = tiles
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def row(cnt, idx, bi, h, r):
        bi, h = min(bi, cnt.shape[0] - 1), min(h, cnt.shape[1] - 1)
        r = min(max(r, 0), cnt.shape[2] - 1)
        c = min(max(int(cnt[bi, h, r]), 0), idx.shape[3])
        return [int(x) for x in idx[bi, h, r, :c]]

    def tile_pair(bi, h, rows, cols, masked):
        rows = rows[rows < sq]
        cols_ok = cols < sk
        s = (q[bi, rows, h] @ k[bi, cols.clamp(max=sk - 1), h // grp].T) * scale
        ok = cols_ok[None, :].expand(len(rows), -1).clone()
        if masked and windowed:
            ok &= allowed_win[rows][:, cols.clamp(max=sk - 1)]
        p = torch.where(ok, torch.exp(s - lse[bi, h, rows, None]), 0.0)
        p = torch.nan_to_num(p, nan=0.0)  # rows with LSE = -inf
        dp = dout[bi, rows, h] @ v[bi, cols.clamp(max=sk - 1), h // grp].T
        ds = p * (dp - dsum[bi, h, rows, None])
        return rows, cols, cols_ok, p, ds

    qr, kr = block_size[0] // dq_m, block_size[1] // dq_n
    nkb = -(-sk // block_size[1])
    for bi in range(b):
        for h in range(hq):
            for m in range(-(-sq // dq_m)):
                full = row(fwd[2], fwd[3], bi, h, m // qr)
                mask = row(fwd[0], fwd[1], bi, h, m // qr)
                for blocks, masked in ((full, False), (mask, True)):
                    for blk in blocks:
                        for sub in range(kr):
                            n = min(max(blk, 0), nkb) * kr + sub
                            rows, cols, ok, _, ds = tile_pair(bi, h, torch.arange(m * dq_m, (m + 1) * dq_m),
                                                              torch.arange(n * dq_n, (n + 1) * dq_n), masked)
                            dq[bi, rows, h] += (ds[:, ok] @ k[bi, cols[ok], h // grp]) * scale
    qr, kr = bwd_block_size[0] // kv_m, bwd_block_size[1] // kv_n
    nqb = -(-sq // bwd_block_size[0])
    for bi in range(b):
        for kh in range(hkv):
            for n in range(-(-sk // kv_n)):
                for g in range(grp):
                    h = kh * grp + g
                    entries = [(x, True) for x in row(bwd[0], bwd[1], bi, h, n // kr)]
                    entries += [(x, False) for x in row(bwd[2], bwd[3], bi, h, n // kr)]
                    for blk, masked in entries:
                        for sub in range(qr):
                            m = min(max(blk, 0), nqb) * qr + sub
                            rows, cols, ok, p, ds = tile_pair(bi, h, torch.arange(m * kv_m, (m + 1) * kv_m),
                                                              torch.arange(n * kv_n, (n + 1) * kv_n), masked)
                            dv[bi, cols[ok], kh] += p[:, ok].T @ dout[bi, rows, h]
                            dk[bi, cols[ok], kh] += (ds[:, ok].T @ q[bi, rows, h]) * scale
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_emulated_schedules_give_the_reference_gradients(causal, given):
    from reference import attention_ref, sparse_allowed

    torch.manual_seed(0)
    b, sq, sk, hq, hkv, dh = 2, 300, 517, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, dh, dtype=torch.float64, requires_grad=True)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    bs = (128, 128)
    nq, nk = -(-sq // 128), -(-sk // 128)
    g = torch.Generator().manual_seed(1)
    m = torch.rand(b, hq, nq, nk, generator=g) < 0.5
    full = m & (torch.rand(b, hq, nq, nk, generator=g) < 0.5)
    m[..., 1, :] = False
    full[..., 1, :] = False
    bst = block_sparse_from_mask(m, bs, full_mask=full)
    fwd = tuple(bst[:4])
    dkdv_t, dq_t = config_bwd.select_bwd_config("bf16", 128, 128), config_bwd.select_dq_config("bf16", 128, 128)
    if given:  # the KV-major lists in blocks of the dK/dV tile: each 128-block split into tiles
        tm, tn = dkdv_t.tile_m, dkdv_t.tile_n
        up = lambda x: x.repeat_interleave(128 // tm, 2).repeat_interleave(128 // tn, 3)  # noqa: E731
        fine = block_sparse_from_mask(up(m).transpose(-1, -2).contiguous(), (tm, tn),
                                      full_mask=up(full).transpose(-1, -2).contiguous())
        bwd, bwd_bs = tuple(fine[:4]), (tm, tn)
    else:
        bwd, bwd_bs = BS.transpose_block_sparse(fwd, nk), bs
    visited, fullm = BS.dense_mask_from_block_sparse(bst, sq, sk)
    mask = sparse_allowed(visited, fullm, sq, sk, causal)
    out, lse = attention_ref(q, k, v, mask=mask, upcast=False)  # float64 throughout
    dout = torch.randn_like(out)
    ref = torch.autograd.grad(out, (q, k, v), dout)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    win = j <= i + sk - sq  # causal, bottom-right
    dsum = (dout * out).sum(-1).transpose(1, 2)
    with torch.no_grad():
        ours = _emulated_sparse_grads(q, k, v, dout, lse, dsum, fwd, bwd, bs, bwd_bs,
                                      ((dq_t.tile_m, dq_t.tile_n), (dkdv_t.tile_m, dkdv_t.tile_n)), causal, win,
                                      dh ** -0.5)
    for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
        # the reference rounds the scores to fp32; a schedule error would be O(1)
        assert torch.allclose(a, r, atol=2e-5, rtol=1e-4), f"{name}: {(a - r).abs().max().item():.3e}"


def test_fp16_sparse_backward_at_d256_raises():
    """The d256 dK/dV tiles spill with block sparsity in fp16 (config_bwd._BWD_SPILLING, "sparse_fp16"): planning
    such a call with grad raises before launch; bf16, fp16 without sparsity and fp16 sparse inference plan."""
    sparse = dict(sparse_q_ratio=1, sparse_kv_ratio=1)
    with pytest.raises(ValueError, match="sparse_fp16"):
        config_bwd.select_bwd_config("fp16", 256, 256, **sparse)
    assert config_bwd.select_bwd_config("bf16", 256, 256, **sparse).block_sparse
    assert not config_bwd.select_bwd_config("fp16", 256, 256).block_sparse
    args = ("fp16", 256, 256, False, False, False, False, False, False, False)
    with pytest.raises(ValueError, match="sparse_fp16"):
        P.get_plan(P.PlanKey(*args, True, 0, sparse=(1, 1, 64, 32), sparse_bwd=(1, 1, 2, 1)))
    assert P.get_plan(P.PlanKey(*args, False, 0, sparse=(1, 1, 64, 32))).bwd_cfg is None


_CALL_FLAGS = ("has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k")


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("d", [64, 96, 128, 192])
def test_lists_are_prepared_for_the_tiles_the_plan_runs(d, tma):
    """prepare_backward's ratios times the tiles the plan selects give the block size back, for every flag subset,
    dtype and mask mod: the KV-major and query-major lists are read with the block size they were made for.  (A d128
    call with an aux-reading mask mod and a window or seqused runs the 64x64 dK/dV tile; the lists were once
    prepared for the key-row 32x128 one.)"""
    import itertools

    from flash_attn_4_sm120 import modspec
    from flash_attn_4_sm120.config_plan import kernel_configs

    doc = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
    checked = 0
    for mods, dtype, windowed in itertools.product((None, doc), ("bf16", "fp16"), (False, True)):
        for bits in itertools.product((False, True), repeat=len(_CALL_FLAGS)):
            flags = dict(zip(_CALL_FLAGS, bits))
            call = dict(dtype=dtype, tma=tma, **flags)
            args = dict(batch=2, heads=4, max_q=3 * 128, max_k=5 * 128, head_dim=d, head_dim_v=d, windowed=windowed,
                        device=torch.device("cpu"))
            try:
                ratios, fwd = BS.check_block_sparse(_fwd(), **args, tma=tma)
                sg = BS.prepare_backward(_fwd(), None, fwd, **args, mods=mods, call=call)
                key = P.PlanKey(dtype, d, d, windowed, flags["has_softcap"], False, flags["varlen_q"],
                                flags["varlen_k"], flags["seqused_q"], flags["seqused_k"], True, 0,
                                sparse=(*ratios, 128, 128), sparse_bwd=(*sg.dq_ratios, *sg.dkdv_ratios), mods=mods,
                                tma=tma)
                _, bwd, dq = kernel_configs(key)
            except ValueError:  # a combination the call refuses (it raises before any launch)
                continue
            assert (sg.dkdv_ratios[0] * bwd.tile_m, sg.dkdv_ratios[1] * bwd.tile_n) == (128, 128), (call, mods)
            assert (sg.dq_ratios[0] * dq.tile_m, sg.dq_ratios[1] * dq.tile_n) == (128, 128), (call, mods)
            checked += 1
    assert checked >= 32


def test_sparse_grad_fp16_d96_dv64_is_refused_before_launch():
    """fp16 block-sparse training at head dims (96, 64) is refused on every device before any launch (compat
    ``sparse_grad_fp16_d96_dv64``: its dK/dV tile spills with CI's toolchain); bf16, (96, 96) and the call without
    gradients still plan; the gate's class sweep skips the refused key."""
    from pathlib import Path
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import stub_device
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import compat

    launched = []
    bst = fa.block_sparse_from_mask(torch.ones(1, 2, 2, 2, dtype=torch.bool), (128, 128))

    def call(dtype, dv, grad):
        q, k = (torch.randn(1, 256, 2, 96, dtype=dtype, requires_grad=grad) for _ in range(2))
        v = torch.randn(1, 256, 2, dv, dtype=dtype, requires_grad=grad)
        return fa.flash_attn_func(q, k, v, block_sparse_tensors=bst)

    with stub_device.stubbed_device("SM120 (test)", (12, 0), 84, lambda cfg, dev: cfg,
                                    lambda fn, record, dev, values: launched.append(fn)):
        with pytest.raises(ValueError, match=r"float16 at head_dim=96, head_dim_v=64 is not supported"):
            call(torch.float16, 64, True)
        assert launched == []
        call(torch.float16, 64, False)
        call(torch.bfloat16, 64, True)
        call(torch.float16, 96, True)
    assert launched
    key = P.PlanKey("fp16", 96, 64, needs_grad=True, sparse=(1, 1, 128, 128), sparse_bwd=(1, 1, 1, 1))
    assert compat.plan_key_conflicts(key) == ("sparse_grad_fp16_d96_dv64",)
    assert compat.plan_key_conflicts(key._replace(dtype="bf16")) == ()
