"""Block sparsity, host side: the ``BlockSparseTensors`` record (keyword-compatible with flash-attn-4 b36's
``block_sparse_tensors``), its checks, and builders from a dense boolean block mask and from PyTorch's
``flex_attention`` ``BlockMask``.  Device side: kernels/block_sparse.py (the listed-blocks schedule).

Semantics, per (batch b, query head h, query block qb of ``block_size[0]`` positions):
  * ``mask_block_cnt[b, h, qb]`` KV blocks (of ``block_size[1]`` keys) listed first in ``mask_block_idx[b, h, qb]``
    are visited with the masks of the call (causal / sliding window; the sequence end always);
  * ``full_block_cnt[b, h, qb]`` blocks listed first in ``full_block_idx[b, h, qb]`` are visited without them;
  * every other KV block is skipped.  A query block with no block at all gives O = 0 and LSE = -inf.
Counts are int32 (B, H, num_q_blocks), indices int32 (B, H, num_q_blocks, width) packed left; B and H may be 1
(broadcast).  Blocks of a varlen call are counted from the start of each sequence.  ``mask_mod``/``score_mod``
are not supported yet (NotImplementedError), so "mask" blocks apply only causal / window.

Counts and indices are the caller's contract: they are not read on the host (no sync), and the kernel clamps
them (counts to [0, width], indices to the blocks of the sequence), so a lie gives wrong numbers but never an
out-of-bounds access.  ``debug_checks=True`` checks them on the host and names the lie.

Backward (autograd): the dQ kernel walks the forward's lists (Q-major); the dK/dV kernel walks the transposed,
KV-major lists ``block_sparse_tensors_bwd`` (flash-attn-4's name): the same record with, per (b, query head h,
user KV block kb), ``mask_block_cnt[b, h, kb]`` / ``mask_block_idx[b, h, kb, :]`` the query blocks that see KV
block kb through the masks and ``full_*`` those that see it whole (counts (B, H, num_kv_blocks), indices
(B, H, num_kv_blocks, <= num_q_blocks), B/H broadcast, ``block_size=(q_block, kv_block)`` as for the forward).
It must describe the same pairs as the forward's lists (the caller's contract, as flash-attn-4's); when it is not
given, ``transpose_block_sparse`` builds it on the device from the forward's (no host sync).  Block sizes of a
call that needs grad must also be multiples of the backward kernels' tiles (``grad_block_multiples``).

The forward runs the tile ``config.select_sparse_tile`` gives for the block size: the warp-specialised TMA kernel
(128x128 at head dims <= 64, 128x64 at 96/128/192), the cp.async kernel on narrower KV tiles (d192 with kv_block an
odd multiple of 32: 128x32; d256: 64x32).  Block sizes are multiples of the finest tile (``config.sparse_tiles``).

Limits of this release: GQA packing is off (``pack_gqa=True`` raises); paged K/V, split-KV and torch.compile are
refused; mask_mod/score_mod are not supported.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .arguments import BlockSparseLists
from .compat import refuse
from .config import select_sparse_tile, sparse_tiles
from .config_bwd import select_bwd_config, select_dq_config

DEFAULT_BLOCK_SIZE = (128, 128)  # flex_attention's default BLOCK_SIZE; a multiple of every sparse forward tile



class BlockSparseTensors(NamedTuple):
    """Block-sparse layout of one attention call (see the module docstring).  ``block_size``: (q_block,
    kv_block), each a multiple of the kernel's query / KV tile; None means DEFAULT_BLOCK_SIZE (128, 128)."""

    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor | None = None
    full_block_idx: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None


def _fail(msg: str, arg: str = "block_sparse_tensors"):
    raise ValueError(f"{arg}: {msg}")


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def block_size_ratios(block_size, head_dim: int, head_dim_v: int, windowed: bool, tma: bool = True
                      ) -> tuple[int, int]:
    """(q_block // tile_m, kv_block // tile_n) for the forward tile this call runs (``select_sparse_tile`` of the
    block size, whose shape does not depend on mods; ``tma``: the device has TMA); ValueError naming the finest
    tile when a block size is not a multiple of any."""
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(_positive_int(b) for b in block_size)):
        _fail(f"block_size must be a pair of positive ints (q_block, kv_block), got {block_size!r}")
    q_block, kv_block = block_size
    tile = select_sparse_tile(head_dim, head_dim_v, windowed, block_size=(q_block, kv_block), tma=tma)
    if q_block % tile.tile_m or kv_block % tile.tile_n:
        refuse("sparse_block_tile", arg="block_sparse_tensors", q_block=q_block, kv_block=kv_block,
               tile_m=tile.tile_m, tile_n=tile.tile_n, tile_m2=2 * tile.tile_m, tile_n2=2 * tile.tile_n, d=head_dim,
               dv=head_dim_v, windowed=", causal/window" if windowed else "")
    return q_block // tile.tile_m, kv_block // tile.tile_n


def _check_pair(name: str, cnt, idx, batch: int, heads: int, num_q_blocks: int, device,
                rows: str = "query blocks (ceil(max_seqlen_q / q_block))", arg: str = "block_sparse_tensors") -> None:
    for what, t, rank in ((f"{name}_block_cnt", cnt, 3), (f"{name}_block_idx", idx, 4)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{what} must be a torch.Tensor, got {type(t).__name__}", arg)
        if t.dtype != torch.int32:
            _fail(f"{what} must be int32, got {t.dtype}", arg)
        if t.device != device:
            _fail(f"{what} is on {t.device}, q on {device}", arg)
        if t.dim() != rank:
            _fail(f"{what} must have {rank} dims, got shape {tuple(t.shape)}", arg)
    b, h, nq = cnt.shape
    if b not in (1, batch) or h not in (1, heads):
        _fail(f"{name}_block_cnt has shape {tuple(cnt.shape)}: its batch extent must be 1 or {batch} and its head "
              f"extent 1 or {heads} (the query heads)", arg)
    if nq < num_q_blocks:
        _fail(f"{name}_block_cnt has {nq} rows of blocks, the call needs {num_q_blocks} {rows}", arg)
    if tuple(idx.shape[:3]) != tuple(cnt.shape):
        _fail(f"{name}_block_idx has shape {tuple(idx.shape)}, its first three dims must equal "
              f"{name}_block_cnt's {tuple(cnt.shape)}", arg)


_NAMES = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")


_NO_FULL: dict = {}


def _no_full_blocks(device) -> tuple:
    """The (count, index) pair of "no full blocks", one per device, never written (the kernels only read it; one
    object, so the memo of transposed lists (``_transposed_memo``) recognises the lists of a call without them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if device not in _NO_FULL or capturing:
        pair = (torch.zeros((1, 1, 1), dtype=torch.int32, device=device),
                torch.zeros((1, 1, 1, 1), dtype=torch.int32, device=device))
        if capturing:  # memory of a graph's pool: not kept past the capture
            return pair
        _NO_FULL[device] = pair
    return _NO_FULL[device]


def _check_tensors(bst, *, batch: int, heads: int, num_rows: int, device, rows: str, arg: str):
    """The four tensors of ``bst`` checked (empty full tensors when none were given), last dim contiguous."""
    if not all(hasattr(bst, n) for n in _NAMES):
        _fail(f"expected a BlockSparseTensors (fields {', '.join(_NAMES)}, block_size), got {type(bst).__name__}",
              arg)
    _check_pair("mask", bst.mask_block_cnt, bst.mask_block_idx, batch, heads, num_rows, device, rows, arg)
    full_cnt, full_idx = bst.full_block_cnt, bst.full_block_idx
    if (full_cnt is None) != (full_idx is None):
        _fail("full_block_cnt and full_block_idx must be given together (or both None)", arg)
    if full_cnt is None:
        full_cnt, full_idx = _no_full_blocks(device)
    else:
        _check_pair("full", full_cnt, full_idx, batch, heads, num_rows, device, rows, arg)
    # the kernel takes the last dim contiguous and int32 strides (a strided or broadcast view is copied, on the
    # device, without a sync)
    tensors = BlockSparseLists._make(t if t.stride(-1) == 1 else t.contiguous()
                                     for t in (bst.mask_block_cnt, bst.mask_block_idx, full_cnt, full_idx))
    for name, t in zip(_NAMES, tensors):
        if max((abs(st) * max(n - 1, 0) for st, n in zip(t.stride(), t.shape)), default=0) >= 2**31:
            _fail(f"{name} spans {t.numel()} elements: its offsets must fit int32", arg)
    return tensors


def check_block_sparse(bst, *, batch: int, heads: int, max_q: int, max_k: int, head_dim: int, head_dim_v: int,
                       windowed: bool, device, debug: bool = False, tma: bool = True):
    """Validate ``bst`` for one call; returns ((q_ratio, kv_ratio), the kernels' arguments.BlockSparseLists) with
    empty full tensors when none were given.  Raises ValueError before any launch."""
    if not all(hasattr(bst, n) for n in _NAMES):
        _fail(f"expected a BlockSparseTensors (fields {', '.join(_NAMES)}, block_size), got {type(bst).__name__}")
    ratios = block_size_ratios(getattr(bst, "block_size", None), head_dim, head_dim_v, windowed, tma)
    q_block, kv_block = getattr(bst, "block_size", None) or DEFAULT_BLOCK_SIZE
    tensors = _check_tensors(bst, batch=batch, heads=heads, num_rows=-(-max_q // q_block), device=device,
                             rows="query blocks (ceil(max_seqlen_q / q_block))", arg="block_sparse_tensors")
    if debug:
        _debug_check_values(tensors, -(-max_k // kv_block), "KV blocks of max_seqlen_k", "block_sparse_tensors")
    return ratios, tensors


def _debug_check_values(tensors, num_blocks: int, what: str, arg: str) -> None:
    """Opt-in host check (one device->host copy per tensor): counts in [0, width], listed indices in
    [0, num_blocks)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        refuse("debug_checks_capture", prefix=f"{arg}: ", what="the sparse tensors", advice="")
    for name, cnt, idx in (("mask", tensors[0], tensors[1]), ("full", tensors[2], tensors[3])):
        width = idx.shape[3]
        bad = (cnt < 0) | (cnt > width)
        if bool(bad.any()):
            where = tuple(bad.nonzero()[0].tolist())
            _fail(f"{name}_block_cnt{list(where)}={int(cnt[where])} is outside [0, {width}] (the width of "
                  f"{name}_block_idx)", arg)
        cols = torch.arange(width, device=idx.device)
        listed = cols < cnt.unsqueeze(-1)
        bad = listed & ((idx < 0) | (idx >= num_blocks))
        if bool(bad.any()):
            where = tuple(bad.nonzero()[0].tolist())
            _fail(f"{name}_block_idx{list(where)}={int(idx[where])} is outside [0, {num_blocks}) (the {what})", arg)


# ---- backward ----------------------------------------------------------------------------------------------------
def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _bwd_tiles(head_dim: int, head_dim_v: int, mods=None, call: dict | None = None):
    """(dK/dV config, dQ config) a block-sparse backward runs, selected as config_plan selects them for the call:
    ``call`` holds its dtype, ``tma`` and flags (windowed, has_softcap, varlen_q, varlen_k, seqused_q, seqused_k),
    which move the tile (a d128 call with an aux-reading mask_mod and a window or a seqused runs 64x64, not the
    key-row 32x128: config_bwd._BWD_SPILLING).  Without ``call``: a bf16 call with no other flag on a device with
    TMA (the shape config_bwd._sparse_shape keeps on devices without it)."""
    call = dict(call or {})
    dtype = call.pop("dtype", "bf16")
    extra = dict(sparse_q_ratio=1, sparse_kv_ratio=1, mods=mods, **call)
    return (select_bwd_config(dtype, head_dim, head_dim_v, **extra),
            select_dq_config(dtype, head_dim, head_dim_v, **extra))


def grad_block_multiples(head_dim: int, head_dim_v: int, windowed: bool, mods=None,
                         call: dict | None = None) -> dict[str, tuple[int, int]]:
    """The (q_block, kv_block) multiples a call that needs grad accepts: "forward" for ``block_sparse_tensors``
    (the forward tile and the dQ kernel's tile, which walks these lists; and the dK/dV kernel's tile when the
    transposed lists are built from them), "backward" for ``block_sparse_tensors_bwd`` (the dK/dV kernel's tile),
    "auto" for the forward's lists when ``block_sparse_tensors_bwd`` is not given.  ``call``: as ``_bwd_tiles``."""
    fwd = sparse_tiles(head_dim, head_dim_v, windowed)[-1]  # the finest: its multiples are the valid block sizes
    dkdv, dq = _bwd_tiles(head_dim, head_dim_v, mods, call)
    f = (_lcm(fwd.tile_m, dq.tile_m), _lcm(fwd.tile_n, dq.tile_n))
    return {"forward": f, "backward": (dkdv.tile_m, dkdv.tile_n),
            "auto": (_lcm(f[0], dkdv.tile_m), _lcm(f[1], dkdv.tile_n))}


def _multiple_ratios(block_size, mult: tuple[int, int], tile: tuple[int, int], arg: str, why: str,
                     head_dim: int, head_dim_v: int) -> tuple[int, int]:
    q_block, kv_block = block_size
    if q_block % mult[0] or kv_block % mult[1]:
        refuse("sparse_grad_block", arg=arg, q_block=q_block, kv_block=kv_block, d=head_dim, dv=head_dim_v,
               mult_q=mult[0], mult_kv=mult[1], why=why)
    return q_block // tile[0], kv_block // tile[1]


@dataclass(frozen=True)
class SparseGrad:
    """What the backward of a block-sparse call needs (host values and the checked tensors): the forward's
    lists (for the dQ kernel) with their ratios to the dQ tile, the KV-major lists (None: built at backward
    time by ``transpose_block_sparse``) with their ratios to the dK/dV tile."""

    fwd_tensors: BlockSparseLists
    fwd_block_size: tuple[int, int]
    dq_ratios: tuple[int, int]
    bwd_tensors: BlockSparseLists | None
    dkdv_ratios: tuple[int, int]
    num_kv_blocks: int  # ceil(max_seqlen_k / kv_block) of the forward's block size

    def backward_tensors(self) -> BlockSparseLists:
        if self.bwd_tensors is not None:
            return self.bwd_tensors
        return _transposed_memo(self.fwd_tensors, self.num_kv_blocks)


# The KV-major lists built from a forward's lists, kept for the next backward with the same lists: a training loop
# passes one mask every step, and building them is about fifteen small launches (their GPU time and host cost on
# every step).  An entry is used only for the very same tensor objects (weak references), unmodified since (their
# version counters), on the same stream; never while a CUDA graph is being captured.
_TRANSPOSED: OrderedDict = OrderedDict()
_TRANSPOSED_MAX = 8


def _transposed_memo(tensors, num_kv_blocks: int) -> BlockSparseLists:
    live = [t for t in tensors if t is not None]
    if not live or not live[0].is_cuda or torch.cuda.is_current_stream_capturing():
        return transpose_block_sparse(tensors, num_kv_blocks)
    stream = torch.cuda.current_stream(live[0].device).cuda_stream
    key = (tuple(id(t) for t in tensors), tuple(t._version if t is not None else -1 for t in tensors),
           num_kv_blocks, stream)
    hit = _TRANSPOSED.get(key)
    if hit is not None:
        refs, out = hit
        if all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors)):
            _TRANSPOSED.move_to_end(key)
            return out
        del _TRANSPOSED[key]
    out = transpose_block_sparse(tensors, num_kv_blocks)
    _TRANSPOSED[key] = (tuple(weakref.ref(t) if t is not None else None for t in tensors), out)
    while len(_TRANSPOSED) > _TRANSPOSED_MAX:
        _TRANSPOSED.popitem(last=False)
    return out


def prepare_backward(bst, bst_bwd, fwd_tensors, *, batch: int, heads: int, max_q: int, max_k: int, head_dim: int,
                     head_dim_v: int, windowed: bool, device, debug: bool = False, mods=None,
                     call: dict | None = None) -> SparseGrad:
    """Check the block sizes (and ``bst_bwd`` when given) of a block-sparse call that needs grad, before any
    launch.  ``fwd_tensors``: the forward's checked tensors (``check_block_sparse``); ``mods``: the call's
    modspec.ModSpec and ``call`` its dtype, ``tma`` and flags (``_bwd_tiles``): the ratios are computed for the
    tiles the backward will run."""
    call = {**(call or {}), "windowed": windowed}
    mult = grad_block_multiples(head_dim, head_dim_v, windowed, mods, call)
    dkdv, dq = _bwd_tiles(head_dim, head_dim_v, mods, call)
    block_size = tuple(getattr(bst, "block_size", None) or DEFAULT_BLOCK_SIZE)
    num_kv_blocks = -(-max_k // block_size[1])
    if bst_bwd is None:
        dq_ratios = _multiple_ratios(block_size, mult["auto"], (dq.tile_m, dq.tile_n), "block_sparse_tensors",
                                     "the tiles of the forward, dQ and dK/dV kernels, block_sparse_tensors_bwd "
                                     "being built from these lists", head_dim, head_dim_v)
        dkdv_ratios = (block_size[0] // dkdv.tile_m, block_size[1] // dkdv.tile_n)
        return SparseGrad(fwd_tensors, block_size, dq_ratios, None, dkdv_ratios, num_kv_blocks)
    dq_ratios = _multiple_ratios(block_size, mult["forward"], (dq.tile_m, dq.tile_n), "block_sparse_tensors",
                                 "the tiles of the forward and dQ kernels", head_dim, head_dim_v)
    bwd_size = getattr(bst_bwd, "block_size", None) or DEFAULT_BLOCK_SIZE
    if (not isinstance(bwd_size, (tuple, list)) or len(bwd_size) != 2
            or not all(_positive_int(b) for b in bwd_size)):
        _fail(f"block_size must be a pair of positive ints (q_block, kv_block), got {bwd_size!r}",
              "block_sparse_tensors_bwd")
    bwd_size = tuple(bwd_size)
    dkdv_ratios = _multiple_ratios(bwd_size, mult["backward"], (dkdv.tile_m, dkdv.tile_n),
                                   "block_sparse_tensors_bwd", "the tile of the dK/dV kernel", head_dim, head_dim_v)
    arg = "block_sparse_tensors_bwd"
    bwd = _check_tensors(bst_bwd, batch=batch, heads=heads, num_rows=-(-max_k // bwd_size[1]), device=device,
                         rows="KV blocks (ceil(max_seqlen_k / kv_block))", arg=arg)
    if debug:
        _debug_check_values(bwd, -(-max_q // bwd_size[0]), "query blocks of max_seqlen_q", arg)
    return SparseGrad(fwd_tensors, block_size, dq_ratios, bwd, dkdv_ratios, num_kv_blocks)


def _dense_blocks(cnt: torch.Tensor, idx: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Boolean (…, rows, num_blocks) mask of the listed blocks of (cnt, idx), clamped as the kernels clamp (counts
    to [0, width], indices to [0, num_blocks]; index num_blocks, one past the end, lists nothing).  On the device,
    fixed shapes, no host sync."""
    width = idx.shape[-1]
    listed = torch.arange(width, device=idx.device) < cnt.clamp(0, width).unsqueeze(-1)
    col = torch.where(listed, idx.clamp(0, num_blocks), num_blocks).long()  # unlisted: the spare column
    out = torch.zeros((*cnt.shape, num_blocks + 1), dtype=torch.bool, device=cnt.device)
    out.scatter_(-1, col, listed)  # every write to a real column writes True: order does not matter
    return out[..., :num_blocks]


def transpose_block_sparse(tensors, num_kv_blocks: int) -> BlockSparseLists:
    """The KV-major lists (``block_sparse_tensors_bwd``) of the forward's Q-major tensors (mask_cnt, mask_idx,
    full_cnt, full_idx): per KV block, the query blocks that list it, ascending, packed left; counts
    (B|1, H|1, num_kv_blocks), indices (B|1, H|1, num_kv_blocks, rows of the forward's counts).  On the device
    with torch ops of fixed shapes (a scatter into a dense block mask and a stable sort): no host sync."""
    out = []
    for cnt, idx in ((tensors[0], tensors[1]), (tensors[2], tensors[3])):
        dense = _dense_blocks(cnt, idx, num_kv_blocks).transpose(-1, -2)  # (B, H, num_kv_blocks, num_q_blocks)
        c, i = _pack_left(dense)
        out += [c.contiguous(), i.contiguous()]
    return BlockSparseLists(*out)


def _pack_left(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the True entries of the last dim, indices ascending and packed left (on the device)."""
    cnt = mask.sum(-1, dtype=torch.int32)
    # stable sort of "not listed" puts the listed blocks first, in ascending order
    idx = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return cnt, idx


def block_sparse_from_mask(block_mask: torch.Tensor, block_size=DEFAULT_BLOCK_SIZE,
                           full_mask: torch.Tensor | None = None) -> BlockSparseTensors:
    """Build BlockSparseTensors from a dense boolean block mask (B, H, num_q_blocks, num_kv_blocks) (B, H may be
    1): True = the block is visited with the masks of the call.  ``full_mask`` (same shape, optional): blocks
    visited without masks (they are visited whatever ``block_mask`` says there).  On the device, no host sync."""
    for name, m in (("block_mask", block_mask), ("full_mask", full_mask)):
        if m is None:
            continue
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 4:
            _fail(f"{name} must be a 4-D bool tensor (B, H, num_q_blocks, num_kv_blocks), got "
                  f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
    if full_mask is not None:
        if full_mask.shape != block_mask.shape or full_mask.device != block_mask.device:
            _fail(f"full_mask {tuple(full_mask.shape)} on {full_mask.device} must match block_mask "
                  f"{tuple(block_mask.shape)} on {block_mask.device}")
    block_size = tuple(block_size)
    if len(block_size) != 2 or not all(_positive_int(b) for b in block_size):
        _fail(f"block_size must be a pair of positive ints, got {block_size!r}")
    partial = block_mask if full_mask is None else block_mask & ~full_mask
    mask_cnt, mask_idx = _pack_left(partial)
    full_cnt = full_idx = None
    if full_mask is not None:
        full_cnt, full_idx = _pack_left(full_mask)
    return BlockSparseTensors(mask_cnt, mask_idx, full_cnt, full_idx, block_size)


def block_sparse_from_flex(block_mask) -> BlockSparseTensors:
    """Convert a ``torch.nn.attention.flex_attention.BlockMask`` (from ``create_block_mask``): its partial blocks
    (``kv_num_blocks``/``kv_indices``) become mask blocks, its full blocks (``full_kv_num_blocks``/
    ``full_kv_indices``) full blocks, with its ``BLOCK_SIZE``.  No copy of the indices, no host sync.

    The BlockMask's ``mask_mod`` is not carried over (mask_mod is not supported yet): a partial block gets the
    causal / window masks of the call, so the result equals ``flex_attention`` when the mask_mod is causal
    (pass ``causal=True``), a sliding window (pass ``window_size``) or when the mask has no partial blocks (e.g.
    documents aligned to the block size).  Its q-side tensors give ``block_sparse_bwd_from_flex``."""
    needed = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE")
    missing = [n for n in needed if not hasattr(block_mask, n)]
    if missing:
        _fail(f"expected a flex_attention BlockMask, got {type(block_mask).__name__} (missing {missing})")
    bs = block_mask.BLOCK_SIZE
    bs = (int(bs), int(bs)) if isinstance(bs, int) else (int(bs[0]), int(bs[1]))

    def i32(t):
        return None if t is None else (t if t.dtype == torch.int32 else t.to(torch.int32))

    return BlockSparseTensors(i32(block_mask.kv_num_blocks), i32(block_mask.kv_indices),
                              i32(block_mask.full_kv_num_blocks), i32(block_mask.full_kv_indices), bs)


def block_sparse_bwd_from_flex(block_mask) -> BlockSparseTensors:
    """The KV-major lists (``block_sparse_tensors_bwd``) of a flex_attention ``BlockMask``: its q-side tensors
    (``q_num_blocks``/``q_indices`` as mask blocks, ``full_q_num_blocks``/``full_q_indices`` as full blocks), with
    its ``BLOCK_SIZE``.  No copy of the indices, no host sync.  Optional: without it the backward transposes the
    forward's lists itself."""
    needed = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "BLOCK_SIZE")
    missing = [n for n in needed if not hasattr(block_mask, n)]
    if missing:
        _fail(f"expected a flex_attention BlockMask, got {type(block_mask).__name__} (missing {missing})",
              "block_sparse_tensors_bwd")
    if block_mask.q_num_blocks is None or block_mask.q_indices is None:
        _fail("this BlockMask has no q-side tensors (q_num_blocks / q_indices)", "block_sparse_tensors_bwd")
    bs = block_mask.BLOCK_SIZE
    bs = (int(bs), int(bs)) if isinstance(bs, int) else (int(bs[0]), int(bs[1]))

    def i32(t):
        return None if t is None else (t if t.dtype == torch.int32 else t.to(torch.int32))

    return BlockSparseTensors(i32(block_mask.q_num_blocks), i32(block_mask.q_indices),
                              i32(block_mask.full_q_num_blocks), i32(block_mask.full_q_indices), bs)


def dense_mask_from_block_sparse(bst: BlockSparseTensors, seqlen_q: int, seqlen_k: int):
    """(visited, full) boolean element masks (B, H, seqlen_q, seqlen_k) of ``bst`` (for tests and debugging):
    ``visited`` marks keys in a listed block, ``full`` those in a full block.  Counts/indices are clamped as the
    kernel does."""
    q_block, kv_block = bst.block_size or DEFAULT_BLOCK_SIZE
    nk = -(-seqlen_k // kv_block)

    def blocks(cnt, idx):
        if cnt is None:
            return None
        width = idx.shape[-1]
        c = cnt.long().clamp(0, width)
        listed = torch.arange(width, device=idx.device) < c.unsqueeze(-1)
        i = idx.long().clamp(0, nk)  # one past the end: an empty block
        out = torch.zeros((*cnt.shape, nk + 1), dtype=torch.bool, device=cnt.device)
        out.scatter_(-1, torch.where(listed, i, torch.full_like(i, nk)), listed)  # unlisted entries go to nk
        out[..., nk] = False
        return out[..., :nk]

    def expand(b):
        e = b.repeat_interleave(q_block, dim=2).repeat_interleave(kv_block, dim=3)
        nq = -(-seqlen_q // q_block)
        if e.shape[2] < nq * q_block:
            _fail(f"the counts cover {b.shape[2]} query blocks, {nq} are needed")
        return e[:, :, :seqlen_q, :seqlen_k]

    mask = blocks(bst.mask_block_cnt, bst.mask_block_idx)
    full = blocks(bst.full_block_cnt, bst.full_block_idx)
    mask_e = expand(mask)
    full_e = torch.zeros_like(mask_e) if full is None else expand(full)
    return mask_e | full_e, full_e


__all__ = ["BlockSparseTensors", "DEFAULT_BLOCK_SIZE", "SparseGrad", "block_sparse_bwd_from_flex",
           "block_sparse_from_flex",
           "block_sparse_from_mask", "block_size_ratios", "check_block_sparse", "dense_mask_from_block_sparse",
           "grad_block_multiples", "prepare_backward", "transpose_block_sparse"]
