"""The one table of feature combinations this bundle refuses, and the one check of a call against it.

Each ``Conflict`` holds the pair (as CONFLICTS_LOG.md names it), the exception, the message (a format string of
the call's values) and the reason; ``scripts/conflicts_log.py`` renders the table into CONFLICTS_LOG.md (``--check``
in CI).  ``check_call`` runs once per attention call, in ``interface._attention`` after the arguments are
normalised and before any planning: the forward path (dispatch.run_forward, the torch.library op, autograd) runs
only calls that passed it.  ``check_kvcache`` is the same for the arguments only ``flash_attn_with_kvcache`` takes.

A refusal that depends on a limit known only while planning (a tile table, the device's record, the batch) names
the function that checks it (``limit``), which runs once per call: without a ``message`` the message is that
function's own (it names the tiles); with one, the function raises this row through ``refuse`` (the message lives
here, the values come from the plan).

Host only: no CuTe-DSL import, no side effects.
"""

from __future__ import annotations

from typing import NamedTuple


class Conflict(NamedTuple):
    pair: str  # the pair cell of CONFLICTS_LOG.md
    error: type
    message: str  # format string of the call's values ("" when ``limit`` raises it)
    why: str  # CONFLICTS_LOG.md's resolution prose after the error
    tests: tuple = ()
    limit: str = ""  # the function that checks the limit and raises (a feature x limit refusal)


CONFLICTS: dict[str, Conflict] = {
    "dropout_split": Conflict(
        "`dropout_p` × split-KV", ValueError,
        "dropout_p={p} with num_splits={n}: dropout and split-KV are not supported together (split-KV is an "
        "inference path with no backward); use num_splits=1 for a call with dropout",
        "`dropout_p > 0` with `num_splits != 1` (N > 1, or ≤ 0 automatic; the default None means 1 there) is refused "
        "before launch, naming both. Split-KV is inference-only; the mask itself would need no change, being "
        "independent of the split.", ("test_dropout_with_split_kv_raises_before_launch",)),
    "dropout_sparse": Conflict(
        "`dropout_p` × block sparsity", ValueError,
        "dropout_p={p} with block_sparse_tensors: dropout and block sparsity are not supported together (the "
        "block-sparse kernels, forward and backward, are not built with the dropout keep mask: the compile gate has "
        "no such configuration); pass dropout_p=0 or drop block_sparse_tensors",
        "`block_sparse_tensors` with `dropout_p > 0` is refused before the lists are read, naming both: the "
        "block-sparse kernels, forward and backward, are not built with the keep mask (the compile gate has no "
        "such configuration; the block-sparse backward itself exists, see Backward).",
        ("test_dropout_with_block_sparse_raises_before_launch",)),
    "dropout_paged": Conflict(
        "`dropout_p` × `page_table`", ValueError,
        "dropout_p={p} with paged K/V (page_table): paged K/V is inference-only and has no dropout; pass dropout_p=0",
        "paged K/V is inference-only: inference has no use for dropout, and the compile gate builds no paged "
        "kernel with dropout.", ("test_dropout_with_paged_kv_raises",)),
    "dropout_mods_head_dim": Conflict(
        "`dropout_p` × score/mask mods × head dim / devices without TMA", ValueError, "",
        "0 < `dropout_p` < 1 with mods runs only the tiles of `config.MODS_DROPOUT_TILES` (every other tile "
        "spilled with both, see the `dropout_p` × score/mask mods row): none at max(d, dv) = 256, and only TMA "
        "tiles at head dim ≤ 128, so devices without TMA (8.0/8.6/8.9) are refused there. p = 0 and p = 1 run the "
        "kernels without dropout and are accepted.",
        ("test_dropout_with_mods_at_d256_raises_before_launch_through_the_api", "test_mods_with_dropout_without_tma"),
        "config.mods_dropout_fwd_tile"),
    "softcap_score_mod": Conflict(
        "`softcap` × `score_mod`", ValueError,
        "softcap={softcap} together with score_mod: softcap is itself a score modification; write it into the "
        "score_mod (softcap * tanh(score / softcap)) and its score_mod_bwd, or leave softcap at 0",
        "both would rewrite the scores, and which runs first changes the result: the score_mod takes the cap "
        "instead (the `mods.py` library shows how).", ("test_softcap_with_score_mod_raises_before_launch_through_the_api",)),
    "mods_compile": Conflict(
        "score/mask mods × torch.compile", NotImplementedError,
        "score_mod/mask_mod are not supported under torch.compile yet (the torch.library op does not take "
        "callables); call it eagerly",
        "the torch.library op's schema has no place for a callable.", ()),
    "paged_grad": Conflict(
        "`page_table` × autograd", ValueError,
        "paged K/V (page_table) is inference-only: the backward does not read pages. Call it under torch.no_grad() "
        "or with tensors that do not require grad (got q, k, v or learnable_sink with requires_grad=True)",
        "a call with grad enabled and any input requiring grad is refused before launch: the backward does not read "
        "pages (under torch.compile the op skips the backward validation for paged calls).",
        ("test_requires_grad_paged_call_raises_before_launch",)),
    "split_grad": Conflict(
        "split-KV × autograd", ValueError,
        "num_splits > 1 (split-KV) is inference-only: the backward does not split. Call it under torch.no_grad() or "
        "with tensors that do not require grad, or leave num_splits at 1",
        "N > 1 with an input requiring grad is refused before launch; automatic means 1 for such a call.",
        ("test_requires_grad_split_call_raises_before_launch",)),
    "sparse_compile": Conflict(
        "`block_sparse_tensors` × torch.compile", NotImplementedError,
        "block_sparse_tensors is not supported under torch.compile yet (the torch.library op does not take it); "
        "call it eagerly",
        "the torch.library op's schema does not carry the block lists yet.", ()),
    "sparse_split": Conflict(
        "`block_sparse_tensors` × split-KV", ValueError,
        "num_splits={n} with block_sparse_tensors is not supported by flash-attn-4-sm120 (block-sparse calls run "
        "one split); use num_splits=1 or 0",
        "one split: automatic (≤ 0) means 1 (the sparse schedule lists KV blocks per query block; cutting those "
        "lists into splits is not implemented).", ()),
    "sparse_paged": Conflict(
        "`block_sparse_tensors` × `page_table`", NotImplementedError,
        "block_sparse_tensors cannot be combined with page_table (paged K/V) yet",
        "the block-sparse producer issues TMA boxes over contiguous K/V; a paged walk of the lists is not built.",
        ("test_public_api_refuses_before_any_launch",)),
    "sparse_pack_gqa": Conflict(
        "`block_sparse_tensors` × `pack_gqa=True`", ValueError,
        "block_sparse_tensors runs without GQA packing (each query head has its own rows of blocks): pass "
        "pack_gqa=None or False",
        "each query head has its own rows of blocks, so packing is off for block-sparse calls; None/False run "
        "unpacked.", ()),
    "sparse_grad_fp16_d96_dv64": Conflict(
        "`block_sparse_tensors` × autograd × fp16 at head_dim=96, head_dim_v=64", ValueError,
        "block_sparse_tensors with gradients in float16 at head_dim=96, head_dim_v=64 is not supported: its dK/dV "
        "kernel spills registers with one of the two CuTe-DSL toolchains the bundle is built with. Use bfloat16, "
        "call it without gradients (torch.no_grad()), or without block_sparse_tensors",
        "the key-row dK/dV tile of that head-dim pair (64x128) in its lightest block-sparse set spills 2 STL/LDL "
        "on sm_120a with nvidia-cutlass-dsl-libs cu12 (CI's) and none with cu13 (the refresh of "
        "benchmarks/results/gate_full_sm_120a.jsonl at commit 0049e0e; the same SASS as before the backward's "
        "launch-order change, `sass_compare --base 56bdda4~1`). The gate cannot vouch for the class, so the call "
        "is refused before launch until another tile is gated for it.",
        ("test_sparse_grad_fp16_d96_dv64_is_refused_before_launch",)),
    "sparse_bwd_alone": Conflict(
        "`block_sparse_tensors_bwd` × no `block_sparse_tensors`", ValueError,
        "block_sparse_tensors_bwd (the KV-major lists of the backward) was given without block_sparse_tensors (the "
        "forward's lists): give both, or neither",
        "the KV-major lists describe the forward's (query block, KV block) pairs; without the forward's lists "
        "there is nothing they could match.", ("test_public_api_refuses_before_any_launch",)),
    "paged_cu_seqlens_k": Conflict(
        "`page_table` × `cu_seqlens_k`", ValueError,
        "page_table cannot be combined with cu_seqlens_k: with paged K/V the lengths come from seqused_k (leave "
        "cu_seqlens_k=None)",
        "with paged K/V the lengths come from `seqused_k` (flash-attn-4's rule).",
        ("test_page_table_with_cu_seqlens_k_raises_first",)),
    "split_compile": Conflict(
        "split-KV × torch.compile", NotImplementedError,
        "num_splits={n} under torch.compile is not supported by flash-attn-4-sm120 (the compiled op runs one "
        "split); use num_splits=1 or 0 (automatic: one split when compiled), or call it outside torch.compile",
        "the compiled op runs one split; automatic means 1 there.", ()),
    "kvcache_grad": Conflict(
        "`flash_attn_with_kvcache` × autograd", ValueError,
        "flash_attn_with_kvcache is inference-only (no backward through a KV cache): call it under torch.no_grad() "
        "or with tensors that do not require grad",
        "a call with grad enabled and any input requiring grad is refused: there is no backward through a KV cache.",
        ("test_requires_grad_paged_call_raises_before_launch",)),
    "kvcache_block_table": Conflict(
        "`flash_attn_with_kvcache` × `page_table` with `block_table`", ValueError,
        "give the page table once: page_table or block_table (its FlashAttention-2 name), not both",
        "`block_table` is FlashAttention-2's name for the page table; both given are refused unless they are the "
        "same tensor.", ("test_kvcache_rejects",)),
    "kvcache_batch_idx_pages": Conflict(
        "`flash_attn_with_kvcache` × `cache_batch_idx` with a page table", ValueError,
        "cache_batch_idx cannot be combined with a page table: with paged K/V the page table already chooses the "
        "cache pages of each sequence",
        "the page table already picks the pages of each sequence.", ("test_kvcache_contiguous_append_and_cache_batch_idx",)),
    "kvcache_varlen_append": Conflict(
        "`flash_attn_with_kvcache` × append with varlen q (`cu_seqlens_q` with `k`/`v`)", NotImplementedError,
        "appending k/v with cu_seqlens_q (varlen q) is not supported by flash-attn-4-sm120; append with a dense q, "
        "or write the cache first",
        "the append writes S_new rows per entry of a dense q's batch. Varlen q without an append is supported "
        "(chunked prefill over the cache).", ("test_kvcache_rejects",)),
    "split_pdl": Conflict(
        "split-KV × devices without programmatic dependent launch", ValueError,
        "num_splits={n}: {problem}; use num_splits=1 (or 0: automatic, which does not split there)",
        "the split forward and the combine kernel order themselves with griddepcontrol (capability 9.0 or later); "
        "a forced N > 1 is refused there, automatic means 1.", (), "splitkv.resolve_num_splits"),
    "split_max": Conflict(
        "split-KV × number of splits", ValueError,
        "num_splits={n} exceeds the supported maximum {limit}",
        "the combine kernel holds one LSE per split of a row in shared memory (`config_combine.COMBINE_MAX_SPLITS`).",
        ("test_forced_splits_above_the_combine_limit_raise",), "splitkv.resolve_num_splits"),
    "split_grid": Conflict(
        "split-KV × batch (grid limit)", ValueError,
        "batch * num_splits = {batch} * {n} = {product} exceeds the grid limit {limit}; use fewer splits",
        "the split forward puts batch × splits on the grid's z extent (65535).",
        ("test_batch_times_splits_beyond_grid_z_raises",), "splitkv.resolve_num_splits"),
    "split_head_dim_v": Conflict(
        "split-KV × head_dim_v of the combine", ValueError,
        "num_splits={n}: the split-KV combine cannot take head_dim_v: {problem}",
        "the combine kernel reads rows in vectors whose width must divide head_dim_v "
        "(`splitkv.combine_head_dim_problem`); automatic means 1 there.", (), "splitkv.resolve_num_splits"),
    "sparse_block_tile": Conflict(
        "`block_sparse_tensors` × block size not a multiple of the forward tile", ValueError,
        "{arg}: block_size=({q_block}, {kv_block}) is not a multiple of the kernel tile ({tile_m}, {tile_n}) used "
        "for head_dim={d}, head_dim_v={dv}{windowed}: use q_block in {tile_m}, {tile_m2}, ... and kv_block in "
        "{tile_n}, {tile_n2}, ...",
        "each listed block is walked as whole kernel tiles; the finest tile of the head dims sets the multiples.",
        (), "block_sparse.block_size_ratios"),
    "sparse_grad_block": Conflict(
        "`block_sparse_tensors` × autograd × block size", ValueError,
        "{arg}: block_size=({q_block}, {kv_block}) cannot be used with gradients for head_dim={d}, "
        "head_dim_v={dv}: q_block must be a multiple of {mult_q} and kv_block a multiple of {mult_kv} ({why}; "
        "(128, 128) always works)",
        "the backward's dQ and dK/dV kernels walk the same lists with their own tiles: the block size must be a "
        "multiple of each (`block_sparse.grad_block_multiples`).", (), "block_sparse._multiple_ratios"),
    "score_mod_grad_no_bwd": Conflict(
        "`score_mod` × autograd without `score_mod_bwd`", ValueError,
        "score_mod={mod} needs score_mod_bwd for the backward (the gradient of the modded score w.r.t. the score "
        "it was given); pass score_mod_bwd= or call under torch.no_grad()",
        "the backward needs the derivative of the modded score, which a forward-only callable cannot give.",
        (), "modspec.check_mods"),
    "dropout_capture_no_seed": Conflict(
        "`dropout_p` × CUDA graph capture without `dropout_seed`", ValueError,
        "dropout without dropout_seed reads torch's CUDA generator on the host, which would freeze one mask into a "
        "captured CUDA graph; pass dropout_seed as a CUDA int64 tensor (and change it between replays), or capture "
        "without dropout",
        "the seed and offset would be read once at capture and replayed as constants: every replay the same mask.",
        (), "dropout.resolve"),
    "varlen_capture_max_seqlen": Conflict(
        "varlen (`cu_seqlens`) × CUDA graph capture without `max_seqlen`", ValueError,
        "max_seqlen_{which} is required when capturing a CUDA graph with varlen inputs",
        "without it the longest sequence is read from `cu_seqlens` on the host, a device->host copy a capture "
        "cannot make (and would freeze into the graph).", (), "validate.max_len"),
    "debug_checks_capture": Conflict(
        "`debug_checks` × CUDA graph capture", ValueError,
        "{prefix}debug_checks read {what} on the host, which cannot be done while capturing a CUDA graph{advice}",
        "the checks copy the metadata (cu_seqlens/seqused, the page table, the block-sparse lists) to the host, "
        "which a capture cannot do; turn them off for the capture.", (),
        "validate.debug_check_lengths, validate.debug_check_pages, block_sparse._debug_check_values"),
    "combine_grad": Conflict(
        "`flash_attn_combine` × autograd", ValueError,
        "flash_attn_combine is inference-only (it has no backward) but out_partial/lse_partial require grad; call "
        "it under torch.no_grad() or pass detached tensors",
        "the combine kernel has no backward (split-KV is inference-only).", (), "combine.check_combine"),
}


# ---- FP8 (e4m3) forward: its feature-pair refusals (dispatch_fp8.py / dispatch_fp8_varlen.py call check_fp8 before
# any launch; value checks — dtypes, descale shapes, layouts — stay in dispatch_fp8.check_fp8_call) ----
CONFLICTS.update({
    "fp8_compile": Conflict(
        "float8_e4m3fn q/k/v × torch.compile", NotImplementedError,
        "FP8 attention under torch.compile is not supported by flash-attn-4-sm120 yet (no torch.library op for "
        "it); call it eagerly",
        "the FP8 forward has no torch.library op (and no fake implementation) yet.", ()),
    "fp8_grad": Conflict(
        "float8_e4m3fn q/k/v × autograd", ValueError,
        "FP8 attention is inference only: q/k/v (or learnable_sink) require grad; call it under torch.no_grad() / "
        "torch.inference_mode(), or use bf16/fp16 inputs to train",
        "there is no FP8 backward: a call whose q, k, v (or appended k/v) or learnable_sink requires grad with grad "
        "enabled is refused before anything launches (`flash_attn_with_kvcache` refuses it as `kvcache_grad`).",
        ("test_grad_call_raises_before_launch", "test_grad_and_e5m2_raise_before_launch_on_the_gpu",
         "test_varlen_grad_e5m2_and_a_bf16_query_raise")),
    "fp8_unserved": Conflict(
        "float8_e4m3fn q/k/v × dropout / `page_table` in `flash_attn_func` / `cache_batch_idx` / "
        "varlen q in `flash_attn_with_kvcache` / `seqused_q` / mods / block sparsity / qv / `debug_checks`",
        NotImplementedError,
        "{feature} is not supported with FP8 inputs by flash-attn-4-sm120 yet (the FP8 forward serves causal/"
        "non-causal attention with sliding window, softcap, sink, GQA packing and split-KV, dense, varlen and over a "
        "contiguous or paged KV cache); "
        "leave it at its default or use bf16/fp16 inputs",
        "the FP8 kernel (kernels/fwd_fp8.py) is built without them: each is named before launch. `num_splits` and "
        "`pack_gqa` follow the bf16 path's rules (a split over dense K/V whose batch stride is not seqlen x row "
        "stride is refused under this name: split-KV reads K/V as packed rows). Paged e4m3 K/V is served by "
        "`flash_attn_with_kvcache` and `flash_attn_varlen_func` (`page_table`, the kernel's paged form); "
        "`flash_attn_func` has no lengths to go with a table and refuses it here.",
        ("test_unserved_features_raise_before_launch", "test_varlen_refusals_name_the_argument",
         "test_a_split_over_kv_that_cannot_be_read_as_rows_is_refused",
         "test_kvcache_refusals_name_the_argument", "test_varlen_page_table_refusals")),
})


# ---- devices without TMA (8.0 / 8.6 / 8.9, sm_80 cubins): combinations whose every tile spills there, or whose
# tile that does not spill breaks another contract (config_bwd / config raise these while planning) ----
CONFLICTS.update({
    "sparse_grad_without_tma": Conflict(
        "`block_sparse_tensors` × autograd × devices without TMA (feature sets whose dK/dV tile of the block "
        "sizes' shape spills)", ValueError,
        "block_sparse_tensors with gradients in {dtype} at head_dim={d}, head_dim_v={dv}{flags}{mods} cannot run "
        "on {device}: the dK/dV tile whose shape ({tile}) the block sizes are checked against spills registers "
        "there with this feature set, and the tiles that do not spill have another shape ({reasons}). Call it "
        "without gradients (torch.no_grad()), without block_sparse_tensors, or on a device with TMA (9.0, 12.x)",
        "on a device without TMA the kernels are sm_80 cubins, whose register allocation spills where sm_120a's "
        "does not (benchmarks/results/gate_spill_probes_sm80_s33.jsonl). A device without TMA runs only a dK/dV "
        "tile of the shape the TMA table picks for bf16 without other flags (`config_bwd._sparse_shape`; the lists "
        "are prepared for the tile the call runs, `block_sparse._bwd_tiles`, so this is a restriction kept until "
        "the other shapes are gated for sm_80); where every such tile spills the call is refused at the forward: fp16 at head dim 96 (the key-row tile spills with block sparsity on "
        "sm_80), and at 128 a call with an aux-reading mask mod and a window or varlen k / seqused without varlen "
        "q (those feature sets spill both 32x128 tiles, `config_bwd._BWD_SPILLING`).",
        ("test_sparse_grad_without_tma_is_refused_where_no_tile_of_its_shape_fits",),
        "config_bwd.select_bwd_config"),
})


def check_fp8(*, compiling: bool, needs_grad: bool, unsupported: dict) -> None:
    """The FP8 forward's conflicts, in the order they win: torch.compile, grad, then each unserved feature
    (``unsupported``: its name as the message shows it -> whether the call uses it)."""
    if compiling:
        refuse("fp8_compile")
    if needs_grad:
        refuse("fp8_grad")
    for name, on in unsupported.items():
        if on:
            refuse("fp8_unserved", feature=name)

def _sparse_grad_unbuilt(dtype, head_dim: int, head_dim_v: int) -> bool:
    """The block-sparse backward class the compile gate cannot vouch for (``sparse_grad_fp16_d96_dv64``);
    ``dtype``: a torch dtype or the plan key's name."""
    return str(dtype) in ("torch.float16", "fp16") and head_dim == 96 and head_dim_v == 64


def plan_key_conflicts(key) -> tuple[str, ...]:
    """The names of the table's pair refusals a plan key (plan.PlanKey) carries: what ``check_call`` refuses for a
    call, read from the key, for walks over plan keys (the compile gate's class sweep) that must meet only what a
    call can run.  Calls never reach the planner with one of these (``check_call`` raised first)."""
    out = []
    if key.needs_grad and key.sparse[0] and _sparse_grad_unbuilt(key.dtype, key.head_dim, key.head_dim_v):
        out.append("sparse_grad_fp16_d96_dv64")
    if key.paged:
        out += [n for n, on in (("paged_grad", key.needs_grad), ("dropout_paged", key.dropout),
                                ("paged_cu_seqlens_k", key.varlen_k), ("sparse_paged", key.sparse[0])) if on]
    return tuple(out)


def refuse(name: str, **values):
    """Raise the table's exception of conflict ``name`` with its message filled from ``values``."""
    c = CONFLICTS[name]
    raise c.error(c.message.format(**values))


def check_call(*, p: float, dropout_p, num_splits: int, sparse: bool, sparse_bwd: bool, paged: bool,
               cu_seqlens_k: bool, pack_gqa, needs_grad: bool, compiling: bool, mods: bool, score_mod: bool, softcap,
               q, v) -> None:
    """Every conflict of one attention call, once, before planning (the order is the order refusals win in).
    ``p``: the checked dropout probability (``dropout_p`` as given, for the message); ``num_splits``: after the
    default is resolved; ``mods``: a score_mod or mask_mod was given; ``score_mod``: a score_mod was given;
    ``q``/``v``: the call's tensors, read only for a limit that depends on their head dims or device (anything else
    is named by validation later)."""
    if p > 0.0:
        if num_splits != 1:
            refuse("dropout_split", p=dropout_p, n=num_splits)
        if sparse:
            refuse("dropout_sparse", p=dropout_p)
    if sparse_bwd and not sparse:
        refuse("sparse_bwd_alone")
    if score_mod and softcap:
        refuse("softcap_score_mod", softcap=softcap)
    if mods:
        if 0.0 < p < 1.0 and hasattr(q, "shape") and hasattr(v, "shape"):
            from .config import mods_dropout_fwd_tile
            from .device import device_caps

            # the table's limit (its message names the tiles); a device is asked only when it is a CUDA one (other
            # tensors are refused by validation, and the plan would raise the same for them)
            tma = device_caps(q.device).tma if getattr(q.device, "type", None) == "cuda" else True
            mods_dropout_fwd_tile(q.shape[-1], v.shape[-1], tma)
        if compiling:
            refuse("mods_compile")
    if paged:
        if needs_grad:
            refuse("paged_grad")
        if p > 0.0:
            refuse("dropout_paged", p=dropout_p)
        if cu_seqlens_k:
            refuse("paged_cu_seqlens_k")
    if num_splits > 1:
        if needs_grad:
            refuse("split_grad")
        if compiling and not sparse:
            refuse("split_compile", n=num_splits)
    if sparse:
        if compiling:
            refuse("sparse_compile")
        if num_splits > 1:
            refuse("sparse_split", n=num_splits)
        if paged:
            refuse("sparse_paged")
        if pack_gqa is True:
            refuse("sparse_pack_gqa")
        if needs_grad and _sparse_grad_unbuilt(getattr(q, "dtype", None), getattr(q, "shape", (0,))[-1],
                                               getattr(v, "shape", (0,))[-1]):
            refuse("sparse_grad_fp16_d96_dv64")


def check_kvcache(*, needs_grad: bool, page_table, block_table, cache_batch_idx, varlen_q: bool,
                  append: bool) -> None:
    """The conflicts of ``flash_attn_with_kvcache``'s own arguments (its attention call then passes
    ``check_call``)."""
    if needs_grad:
        refuse("kvcache_grad")
    if page_table is not None and block_table is not None and page_table is not block_table:
        refuse("kvcache_block_table")
    if cache_batch_idx is not None and (page_table is not None or block_table is not None):
        refuse("kvcache_batch_idx_pages")
    if varlen_q and append:
        refuse("kvcache_varlen_append")


__all__ = ["CONFLICTS", "Conflict", "check_call", "check_kvcache", "refuse"]
