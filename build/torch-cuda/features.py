"""The one table of what this bundle supports.

FEATURES drives three things, so they never drift apart:
  * the dispatcher: ``require(name)`` raises NotImplementedError for a feature that is not available yet;
  * the tests: GPU tests skip features whose status is not "supported";
  * the README support matrix: ``support_matrix_markdown()`` renders it (``scripts/readme_sections.py``).

Host-only module: no CuTe-DSL import, no side effects.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = "supported"
PLANNED = "planned"


@dataclass(frozen=True)
class Feature:
    name: str
    status: str
    api: str
    notes: str = ""

    @property
    def supported(self) -> bool:
        return self.status == SUPPORTED


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("forward", SUPPORTED, "flash_attn_func", "fp16/bf16, out in the input dtype"),
        Feature("varlen", SUPPORTED, "flash_attn_varlen_func(cu_seqlens_q/k, seqused_q/k)",
                "zero-length sequences allowed; no device->host sync when max_seqlen_q/k are given; "
                "debug_checks=True checks cu_seqlens/seqused on the host"),
        Feature("gqa", SUPPORTED, "Hq % Hkv == 0", "MHA, any GQA ratio, MQA; K/V never copied"),
        Feature("causal", SUPPORTED, "causal=True", "bottom-right aligned when Sq != Sk"),
        Feature("sliding_window", SUPPORTED, "window_size=(left, right)",
                "KV blocks outside the window are skipped; causal=True fixes right = 0 (FlashAttention's rule)"),
        Feature("softcap", SUPPORTED, "softcap>0", "tanh soft-capping of the scores"),
        Feature("learnable_sink", SUPPORTED, "learnable_sink=(Hq,) fp32", "per-head sink logit in the denominator"),
        Feature("return_lse", SUPPORTED, "return_lse=True", "fp32 (B, Hq, Sq) / (Hq, total_q)"),
        Feature("head_dim", SUPPORTED, "D in {32, 64, 96, 128, 192, 256}", "Dv != D where it fits (see README)"),
        Feature("backward", SUPPORTED, "autograd (loss.backward())",
                "dQ/dK/dV (+ learnable-sink grad) for every forward feature"),
        Feature("torch_compile", SUPPORTED, "torch.compile(model, fullgraph=True)",
                "forward and backward are torch.library ops with fake implementations: no graph breaks"),
        Feature("deterministic", SUPPORTED, "deterministic=True",
                "bitwise reproducible gradients: at d64 and d128 the fused backward with its dQ adds taken in turns, in "
                "key-tile order (a turn counter per query tile); elsewhere the atomic-free dK/dV + dQ kernel pair; "
                "the default fused backward adds dQ with fp32 atomics in any order "
                "(order-dependent in the last bits)"),
        Feature("paged_kv", SUPPORTED, "flash_attn_varlen_func(page_table=, seqused_k=)",
                "k/v (num_pages, page_size, Hkv, D), any page size >= 1, every forward feature; fused (2, ...) "
                "cache views; prefill calls whose page size is a multiple of the TMA tile's tile_n (e.g. 64 at "
                "d128) run the TMA kernel, one box per K/V tile, other page sizes and split/decode calls the "
                "cp.async kernel; inference only (a grad-requiring call raises)"),
        Feature("kvcache", SUPPORTED, "flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=, ...)",
                "FA2/FA3 keywords; appends k/v (paged or contiguous, cache_batch_idx); no host sync, "
                "CUDA-graph capturable; rotary raises NotImplementedError"),
        Feature("combine", SUPPORTED, "flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, "
                "return_lse=True)",
                "flash-attn-4's split-KV combine: fp32/bf16/fp16 partials, up to 256 splits, head_dim up to 512; "
                "empty splits (LSE -inf) contribute 0, NaN propagates; cu_seqlens/seqused/varlen_batch_idx "
                "raise NotImplementedError"),
        Feature("split_kv", SUPPORTED, "num_splits=None (default: automatic for an inference call whose CTAs "
                "walk >= 8192 keys, else 1), N > 1, 0 (automatic) or 1 (none)",
                "fp32 partials + the combine kernel; paged or contiguous, every forward feature (sink in split 0); "
                "automatic count from the SM count (no host sync, CUDA-graph capturable); inference only (the "
                "default never splits a call that needs grad, has dropout or block sparsity); "
                "num_splits > 1 under torch.compile raises NotImplementedError; not on SM80/SM86/SM89 (the split "
                "kernels use griddepcontrol, sm_90+: automatic means 1, N > 1 raises ValueError)"),
        Feature("block_sparse", SUPPORTED, "block_sparse_tensors=BlockSparseTensors(...)",
                "forward: listed KV blocks per query block (mask blocks get causal/window, full blocks none), "
                "block sizes multiples of the forward tile (TMA kernel up to head dim 192), B/H broadcast, varlen, "
                "GQA (unpacked); "
                "block_sparse_from_mask / block_sparse_from_flex (flex_attention BlockMask); no paged K/V, no "
                "split-KV, no torch.compile yet"),
        Feature("block_sparse_backward", SUPPORTED, "autograd with block_sparse_tensors (+ optional "
                "block_sparse_tensors_bwd)",
                "dQ walks the forward's lists, dK/dV the KV-major lists (built on the device from the forward's "
                "when block_sparse_tensors_bwd is not given: no host sync); block sizes also multiples of the "
                "backward tiles ((128, 128) always works); bitwise reproducible; no torch.compile yet; not in fp16 at "
                "head dims (96, 64) (its dK/dV tile spills with one of the two toolchains: refused before launch)"),
        Feature("score_mask_mods", SUPPORTED, "score_mod=, score_mod_bwd=, mask_mod=, aux_tensors=[...]",
                "upstream flash-attn-4's @cute.jit convention (logical b, h, q_idx, kv_idx under varlen, GQA "
                "packing, paged K/V and split-KV), forward and backward; compiled once per mod (identity + "
                "source); library in flash_attn_4_sm120.mods (causal, sliding window, document, prefix-LM, ALiBi, "
                "relative bias); with block_sparse_tensors the mask_mod runs on mask blocks only (d256 with grad "
                "refused); with dropout_p up to head dim 192 (mods on the scores, dropout on P); softcap with "
                "score_mod, dropout_p at head dim 256, head dims (256, 96) and torch.compile raise"),
        Feature("dropout", SUPPORTED, "dropout_p=p (dropout_seed=, dropout_offset=)",
                "Philox4x32-7, mask a function of (seed, offset, b, h, i, j) only; seed/offset from torch's CUDA "
                "generator unless given; a CUDA int64 seed tensor under graph capture; dropout_mask() "
                "materialises it; with score/mask mods up to head dim 192; not with split-KV (num_splits != 1), "
                "block sparsity, paged KV or mods at head dim 256 (ValueError)"),
        Feature("fp8", SUPPORTED, "float8_e4m3fn q/k/v with q_descale/k_descale/v_descale (B, Hkv) fp32, out_dtype",
                "FlashAttention-3's API through flash_attn_func, flash_attn_varlen_func (cu_seqlens_q/k, seqused_k) "
                "and flash_attn_with_kvcache (contiguous or paged e4m3 cache: page_table / block_table, any page "
                "size, pages looked up per key row; cache_seqlens, e4m3 appends or bf16/fp16 "
                "appends quantized with the cache's descales); an FP8 KV cache with a bf16/fp16 q in "
                "flash_attn_with_kvcache and flash_attn_varlen_func (the kernel reads q and quantizes each "
                "(query row, head) with its own amax scale, output in q's dtype; another out_dtype quantizes q on "
                "the host per (sequence, KV head) first); mma.sync e4m3 "
                "for both GEMMs, P scaled by 16 before its e4m3 rounding; head dims 64/128, causal, sliding "
                "window, softcap (cap * tanh of the descaled scores), learnable sink, GQA with pack_gqa and split-KV (num_splits) under the bf16 path's rules; "
                "bf16/fp16 output; inference only; fp8_quant.quantize_qkv (Hadamard "
                "rotation, per-tensor/head/block scales) makes the inputs. Not yet: e5m2, a bf16/fp16 q in "
                "flash_attn_func, cache_batch_idx, torch.compile (each "
                "refused before launch); not on 8.0/8.6/8.9 devices (sm_80 cubins cannot hold the e4m3 mma)"),
        Feature("pack_gqa", SUPPORTED, "pack_gqa=None|True|False", "query heads of a KV group share a tile"),
        Feature("tma_forward", SUPPORTED, "(automatic)",
                "warp-specialised TMA producer + 8 mma warps where it is faster (d <= 192) on devices with TMA; "
                "cp.async otherwise"),
        Feature("devices", SUPPORTED, "(automatic: device.py's capability table)",
                "compute capability 12.0 / 12.1 (sm_120a / sm_121a) and 9.0 (sm_90a) on every kernel; 8.0 / 8.6 / "
                "8.9 (sm_80 cubins: A100, RTX 30xx, RTX 40xx) on the cp.async kernels and the backward's kernel pair, "
                "on the tiles that compile without spills for sm_80, without split-KV, without score/mask mods "
                "together with dropout at head dim <= 128 and without the block-sparse backward where no tile of "
                "its block sizes' shape compiles without spills there (fp16 at head dim 96; CONFLICTS_LOG). The "
                "compile gate builds what each of sm_120a, sm_80 and sm_121a selects (its full runs and their "
                "counts: README \"The SM120 compile gate\"); the 8.x selection is tested on the 9.0 proxy "
                "(FA4_SM120_FORCE_CPASYNC=1). Any other device, "
                "or a CUTE_DSL_ARCH its cubins cannot run on, raises ValueError naming it before any compile"),
    )
}


def require(name: str, what: str | None = None) -> None:
    """Raise NotImplementedError when feature ``name`` is not available in this release."""
    feat = FEATURES[name]
    if not feat.supported:
        raise NotImplementedError(
            f"{what or feat.api}: the '{name}' feature is not implemented in flash-attn-4-sm120 yet "
            f"(status: {feat.status}). Leave it at its default or use another attention backend for this call."
        )


def support_matrix_markdown() -> str:
    rows = ["| feature | status | how to use | notes |", "|---|---|---|---|"]
    for f in FEATURES.values():
        mark = "yes" if f.supported else "not yet"
        rows.append(f"| {f.name} | {mark} | `{f.api}` | {f.notes} |")
    return "\n".join(rows) + "\n"
