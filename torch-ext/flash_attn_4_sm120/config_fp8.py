"""Host-only configuration of the FP8 (e4m3) forward, kernels/fwd_fp8.py (no CuTe-DSL import, no side effects).

One frozen record per compiled kernel; ``can_implement`` raises ValueError / NotImplementedError naming the value
and the limit, and runs before every compile.  What the FP8 forward serves in this release: dense (B, S, H, D)
or varlen (cu_seqlens_q/k, seqused_k; a contiguous KV cache with cache_seqlens) q/k/v in float8_e4m3fn, head dims
64 and 128 (dv = d), MHA/GQA/MQA, causal or not, sliding window, learnable sink, bf16 or fp16 output, one (B, Hkv)
fp32 descale per tensor (FlashAttention-3's layout), inference only, packed GQA, split-KV and paged K/V on the
packed-rows (varlen) form.  Everything else raises.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FP8_HEAD_DIMS = (64, 128)
FP8_OUT_DTYPES = ("bf16", "fp16")
# the query the kernel reads: e4m3 with a (B, Hkv) q_descale, or a bf16/fp16 query (an FP8 KV cache under a
# high-precision model) that the kernel quantizes itself, one scale per tile row from that row's amax
FP8_Q_DTYPES = ("e4m3", "bf16", "fp16")
SPLIT_OUT_DTYPE = "fp32"  # a split writes fp32 partials; the combine (kernels/combine.py) converts to bf16/fp16
FP8_TILE_M = 64  # 4 warps x 16 query rows
# packed decode rows (query rows x heads of a KV group <= 16, e.g. Sq 1-4 at Hq/Hkv = 4): one 16-row block, so a
# CTA computes the rows it stores rather than 64 of which most are empty (same K/V tiles, a quarter of the mma work).
# Its FP8_DECODE_KV_WARPS warps split the keys of each K/V tile (kv_warps): one warp alone walked a tile in about
# three times the load latency (the mma is emulated on the proxy), so a CTA's loads sat idle most of the time and
# the grid had too few warps per SM to cover them; two warps halve each CTA's walk in the same shared memory, and
# four such CTAs fit an H100 SM (registers), two an SM120 one (shared memory).  Instructions per step: benchmarks/
# experiments/results/fp8_decode_tile_sass_cpu.jsonl; the timing: benchmarks/experiments/fp8_decode_splits.py --tiles
FP8_DECODE_TILE_M, FP8_DECODE_WARPS, FP8_DECODE_KV_WARPS = 16, 2, 2
FP8_TILE_N = 64  # keys per K/V tile
FP8_NUM_WARPS = 4
FP8_NUM_STAGES = 2  # K/V tiles in flight (cp.async double buffer)
# compile targets whose cubins carry mma.sync e4m3 (PTX needs sm_89+): sm_80 cubins, which 8.0/8.6/8.9 devices
# load (device.CAPABILITIES), do not; ptxas rejects "mma with FP8 floating point type" there
# (benchmarks/results/fp8_gate_sm80.jsonl)
FP8_TARGETS = ("sm_90a", "sm_120a", "sm_121a", "sm_120f")
SMEM_LIMIT = 101376  # SM120's shared memory per block
ROW_PAD = 16  # bytes added to each K/V smem row: 8 rows x 4 lanes of 4-byte reads hit 32 distinct banks


@dataclass(frozen=True)
class Fp8FwdConfig:
    head_dim: int
    head_dim_v: int
    causal: bool
    out_dtype: str = "bf16"
    local: bool = False  # a sliding window (left and/or right bound beyond causal), runtime bounds
    has_sink: bool = False  # learnable sink: one fp32 logit per query head in the denominator
    # softcap: scores cap * tanh(s / cap) before the softmax (s the descaled, softmax-scaled score); the cap is a
    # runtime argument, as in the bf16 kernels (config.FwdConfig.has_softcap)
    softcap: bool = False
    varlen: bool = False  # packed rows with per-sequence offsets/lengths (cu_seqlens_q/k, seqused_k), runtime values
    # the query heads of a KV group share a CTA (tile row p: query row p // qpk, head hkv * qpk + p % qpk)
    pack_gqa: bool = False
    split: bool = False  # split-KV: fp32 partials (out_dtype "fp32") of the split's KV tiles, combined by the host
    # paged K/V: k/v (num_pages, page_size, Hkv, D) with a page_table (B, max_pages) int32; key j of sequence b is
    # row j % page_size of page page_table[b, j // page_size] (looked up per row: a page may be smaller than a tile)
    paged: bool = False
    # "bf16" / "fp16": q is read in that dtype and each tile row (a (query row, head) pair) is quantized to e4m3 in
    # the kernel with scale 448 / amax(row); the row's descale joins its softmax scale and no q_descale is read
    q_dtype: str = "e4m3"
    tile_m: int = FP8_TILE_M
    tile_n: int = FP8_TILE_N
    num_warps: int = FP8_NUM_WARPS
    num_stages: int = FP8_NUM_STAGES
    # warps that share a 16-row block, each multiplying tile_n / kv_warps keys of every K/V tile with its own
    # online softmax; merged through shared memory after the last tile (the decode tile only; 1: no key split)
    kv_warps: int = 1

    def name(self) -> str:
        return (f"fwd_fp8_d{self.head_dim}_dv{self.head_dim_v}_{'causal' if self.causal else 'full'}_"
                f"{'local_' if self.local else ''}{'softcap_' if self.softcap else ''}{'sink_' if self.has_sink else ''}{'varlen_' if self.varlen else ''}"
                f"{'pack_' if self.pack_gqa else ''}{'split_' if self.split else ''}{'paged_' if self.paged else ''}"
                f"{'' if self.q_dtype == 'e4m3' else 'q' + self.q_dtype + '_'}{self.out_dtype}_{self.tile_m}x{self.tile_n}_w{self.num_warps}_s{self.num_stages}"
                f"{'_kw' + str(self.kv_warps) if self.kv_warps != 1 else ''}")


def paged_slot(lane, j, chunks: int):
    """Paged K/V loader (kernels/fwd_fp8.py): the warp-local slot of the K/V row that ``lane`` copies in its
    ``j``-th 16-byte chunk copy.  The loader's copy ``tidx + threads * j`` is row ``(tidx + threads * j) // chunks``,
    chunk ``tidx % chunks`` (threads a multiple of chunks, 32 too): warp w's rows of copy j are ``32 // chunks``
    consecutive ones, so a warp touches ``tile_n // num_warps`` rows, numbered by slot ``lane // chunks + (32 //
    chunks) * j``.  Plain integer arithmetic: the kernel calls it on Int32 values, the CPU tests on ints."""
    return lane // chunks + (32 // chunks) * j


def paged_slot_row(slot, warp, chunks: int, threads: int):
    """The tile row (0 .. tile_n - 1) of ``slot`` in ``warp`` (the inverse of ``paged_slot``): lane ``slot % 32``
    looks up its page once per tile and the lanes that copy the row read it with a shuffle."""
    per = 32 // chunks
    return per * warp + slot % per + (threads // chunks) * (slot // per)


def smem_bytes(cfg: Fp8FwdConfig) -> int:
    return (cfg.tile_m * (cfg.head_dim + ROW_PAD)
            + cfg.num_stages * cfg.tile_n * ((cfg.head_dim + ROW_PAD) + (cfg.head_dim_v + ROW_PAD)))


def merge_bytes(cfg: Fp8FwdConfig) -> int:
    """Shared memory the key-split merge parks in the K stages after the last tile: per warp but the first of each
    row block, 32 lanes x (its O registers, dv / 2, plus row max and row sum of its two rows) fp32."""
    blocks = cfg.num_warps // cfg.kv_warps
    return blocks * (cfg.kv_warps - 1) * 32 * (cfg.head_dim_v // 2 + 4) * 4


def can_implement(cfg: Fp8FwdConfig) -> None:
    if cfg.head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"head_dim={cfg.head_dim} is not served by the FP8 forward (served: {FP8_HEAD_DIMS}); "
                         "use bf16/fp16 inputs for other head dims")
    if cfg.head_dim_v != cfg.head_dim:
        raise ValueError(f"head_dim_v={cfg.head_dim_v} != head_dim={cfg.head_dim}: the FP8 forward serves equal "
                         "head dims only")
    for flag in ("causal", "local", "softcap", "has_sink", "varlen", "pack_gqa", "split", "paged"):
        if not isinstance(getattr(cfg, flag), bool):
            raise ValueError(f"{flag} must be True or False, got {getattr(cfg, flag)!r}")
    if cfg.split:
        if cfg.out_dtype != SPLIT_OUT_DTYPE:
            raise ValueError(f"out_dtype={cfg.out_dtype!r} with split=True: a split writes {SPLIT_OUT_DTYPE!r} "
                             "partials (the combine gives bf16/fp16)")
    elif cfg.out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype={cfg.out_dtype!r} is not served by the FP8 forward (served: {FP8_OUT_DTYPES})")
    if cfg.q_dtype not in FP8_Q_DTYPES:
        raise ValueError(f"q_dtype={cfg.q_dtype!r} is not served by the FP8 forward (served: {FP8_Q_DTYPES})")
    if cfg.q_dtype != "e4m3":
        if not cfg.varlen:
            raise ValueError(f"q_dtype={cfg.q_dtype!r} needs varlen=True: a bf16/fp16 query over e4m3 K/V comes "
                             "from flash_attn_with_kvcache / flash_attn_varlen_func, which run the packed-rows form")
        if not cfg.split and cfg.out_dtype != cfg.q_dtype:
            # one configuration per query dtype, not per (query, output) pair: the host quantizes q itself for
            # the rare call whose out_dtype differs from q's (dispatch_fp8_varlen.quantize_in_kernel)
            raise ValueError(f"q_dtype={cfg.q_dtype!r} with out_dtype={cfg.out_dtype!r}: the in-kernel query "
                             "quantization serves an output in q's dtype (or split partials)")
    for flag in ("pack_gqa", "split", "paged"):
        if getattr(cfg, flag) and not cfg.varlen:
            raise ValueError(f"{flag}=True needs varlen=True: the host runs packed GQA, split-KV and paged K/V on "
                             "the packed-rows form only (dense calls that want them are flattened to it)")
    if not isinstance(cfg.kv_warps, int) or cfg.kv_warps < 1 or cfg.num_warps % cfg.kv_warps:
        raise ValueError(f"kv_warps={cfg.kv_warps!r} must be a positive divisor of num_warps={cfg.num_warps}")
    if cfg.tile_m * cfg.kv_warps != 16 * cfg.num_warps:
        raise ValueError(f"tile_m={cfg.tile_m} must be 16 x num_warps={cfg.num_warps} / kv_warps={cfg.kv_warps} "
                         "(one m16 row block per group of key-split warps)")
    if cfg.kv_warps > 1:
        if cfg.tile_m != FP8_DECODE_TILE_M:
            raise ValueError(f"kv_warps={cfg.kv_warps} with tile_m={cfg.tile_m}: the key split serves the packed "
                             f"decode tile (tile_m={FP8_DECODE_TILE_M}) only")
        if (cfg.tile_n // cfg.kv_warps) % 32 or cfg.tile_n % cfg.kv_warps:
            raise ValueError(f"tile_n={cfg.tile_n} / kv_warps={cfg.kv_warps} must be a multiple of 32 (each warp's "
                             "keys are k32 chunks of the P.V mma)")
        k_stage_bytes = cfg.num_stages * cfg.tile_n * (cfg.head_dim + ROW_PAD)
        if merge_bytes(cfg) > k_stage_bytes:
            raise ValueError(f"kv_warps={cfg.kv_warps}: the merge needs {merge_bytes(cfg)} B, over the "
                             f"{k_stage_bytes} B of K stages it reuses")
    if cfg.tile_m == FP8_DECODE_TILE_M and not cfg.pack_gqa:
        raise ValueError(f"tile_m={cfg.tile_m} is the packed decode tile: it needs pack_gqa=True (unpacked rows use "
                         f"tile_m={FP8_TILE_M})")
    if cfg.tile_n % 32 != 0 or cfg.head_dim % 32 != 0:
        raise ValueError(f"tile_n={cfg.tile_n} and head_dim={cfg.head_dim} must be multiples of 32 (the k32 mma)")
    if cfg.num_stages != 2:
        raise ValueError(f"num_stages={cfg.num_stages}: the FP8 kernel double-buffers K/V (num_stages=2 only)")
    if smem_bytes(cfg) > SMEM_LIMIT:
        raise ValueError(f"{cfg.name()} needs {smem_bytes(cfg)} B of shared memory, over SM120's {SMEM_LIMIT} B")


def check_target(arch: str, device_text: str) -> None:
    if arch not in FP8_TARGETS:
        raise ValueError(f"{device_text} runs {arch} cubins, which cannot hold the FP8 mma (targets with it: "
                         f"{FP8_TARGETS}); use bf16/fp16 inputs on this device")


def select_config(head_dim: int, head_dim_v: int, causal: bool, out_dtype: str, local: bool = False,
                  has_sink: bool = False, varlen: bool = False, pack_gqa: bool = False,
                  split: bool = False, rows: int | None = None, paged: bool = False,
                  q_dtype: str = "e4m3", softcap: bool = False) -> Fp8FwdConfig:
    """``rows``: query rows x packed heads of the longest sequence; a packed call with at most FP8_DECODE_TILE_M
    of them runs the key-split decode tile.  ``q_dtype``: FP8_Q_DTYPES (bf16/fp16: quantized in the kernel)."""
    decode = pack_gqa and rows is not None and rows <= FP8_DECODE_TILE_M
    cfg = Fp8FwdConfig(head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                       out_dtype=SPLIT_OUT_DTYPE if split else out_dtype, local=local, has_sink=has_sink,
                       varlen=varlen, pack_gqa=pack_gqa, split=split, paged=paged, q_dtype=q_dtype, softcap=softcap,
                       tile_m=FP8_DECODE_TILE_M if decode else FP8_TILE_M,
                       num_warps=FP8_DECODE_WARPS if decode else FP8_NUM_WARPS,
                       kv_warps=FP8_DECODE_KV_WARPS if decode else 1)
    can_implement(cfg)
    return cfg


def all_configs() -> list[Fp8FwdConfig]:
    """Every configuration the dispatcher can select (the compile gate's FP8 worklist).  Packed GQA and split-KV
    exist on the varlen form only: dense calls that pick them are flattened to packed rows (a view, with
    cu_seqlens made on the device; dispatch_fp8.fp8_attention), so the dense form never needs them, and a split
    writes fp32 partials whatever the output dtype: 64 unsplit configurations x 1 + 32 varlen ones packed, 16
    split ones x 2 (packed or not), and every packed one again with the key-split decode tile (48) -> 176.  Paged
    K/V (flash_attn_with_kvcache's page_table) runs on the varlen form and may pick any of its 144 configurations
    (packing, splitting and the decode tile follow the same rules as a contiguous cache): 144 more -> 320.
    A bf16/fp16 query over e4m3 K/V (q_dtype, quantized in the kernel) runs on any varlen configuration, contiguous
    or paged: each unsplit one again with q_dtype = its out_dtype (96 x 2) and each split one with either query
    dtype (48 x 2 x 2) -> 384 more -> 704.  Softcap (``softcap_subset``) on 200 of them -> 904."""
    base = [Fp8FwdConfig(head_dim=d, head_dim_v=d, causal=c, out_dtype=o, local=w, has_sink=k, varlen=vl)
            for d in FP8_HEAD_DIMS for c in (False, True) for o in FP8_OUT_DTYPES for w in (False, True)
            for k in (False, True) for vl in (False, True)]
    packed = [replace(c, pack_gqa=True) for c in base if c.varlen]
    split = [Fp8FwdConfig(head_dim=d, head_dim_v=d, causal=c, out_dtype=SPLIT_OUT_DTYPE, local=w, has_sink=k,
                          varlen=True, pack_gqa=p, split=True)
             for d in FP8_HEAD_DIMS for c in (False, True) for w in (False, True) for k in (False, True)
             for p in (False, True)]
    decode = [replace(c, tile_m=FP8_DECODE_TILE_M, num_warps=FP8_DECODE_WARPS, kv_warps=FP8_DECODE_KV_WARPS)
              for c in packed + split if c.pack_gqa]
    contiguous = base + packed + split + decode
    e4m3 = contiguous + [replace(c, paged=True) for c in contiguous if c.varlen]
    hp_q = [replace(c, q_dtype=qd) for c in e4m3 if c.varlen
            for qd in (("bf16", "fp16") if c.split else (c.out_dtype,))]
    plain = e4m3 + hp_q
    return plain + [replace(c, softcap=True) for c in plain if softcap_subset(c)]


def softcap_subset(cfg: Fp8FwdConfig) -> bool:
    """Whether the gate's worklist holds ``cfg`` again with softcap: the bf16 family (out_dtype bf16, or with a
    split q_dtype e4m3/bf16) with window and sink both on or both off (200 of 704).  Softcap on all 704 would
    double the list (1408 compiles a full run); the fp16 forms differ from their bf16 twins in the output (or
    query) conversion instructions only, and a window alone or a sink alone sits between the lightest and the
    heaviest of its siblings, so the subset kept holds every other flag (head dims, causal, varlen, packing,
    split, paged, the decode tile, the bf16 query) at both ends of the register load.  The host may select the
    other softcap forms too; they compile on first use like any configuration, outside the gate."""
    bf16_family = cfg.q_dtype in ("e4m3", "bf16") if cfg.split else cfg.out_dtype == "bf16"
    return bf16_family and cfg.local == cfg.has_sink
