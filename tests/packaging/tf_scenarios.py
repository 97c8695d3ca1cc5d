"""Child-side scenarios for the transformers tests (tests/packaging/test_transformers*.py run this file in a fresh
process).

    python tests/packaging/tf_scenarios.py SCENARIO --repo ORG/NAME [--family F] [--padded] [--reference-kernel] [...]

prints one JSON line: the measurements of SCENARIO, which the parent test judges. The environment (HF_ENDPOINT of a
local hub, HF_HOME, ...) is the parent's business; this file only uses public transformers/kernels API to load the
kernel: ``from_config(cfg, attn_implementation=REPO)``, which resolves REPO through ``kernels.get_kernel``.

Every model under test gets its own deep copy of the config: transformers records the attention implementation on
the config object it is given, so two models built from one config object would share the kernel.

Spies: transformers keeps the functions it took from the kernel module in module globals of
``transformers.modeling_flash_attention_utils`` (``_flash_fn``, ``_flash_varlen_fn``, ``_flash_with_kvcache_fn``)
and reads them on every call. After checking that they are the bundle's own functions, they are wrapped by
counting spies, so a scenario proves that the kernel was really called, with which keywords.

``--reference-kernel`` (CPU development and the CPU harness tests): after the bundle has been loaded and checked,
its functions are replaced by a pure-PyTorch FlashAttention reference (tests/reference.py) with the same keywords,
so the whole harness (transformers' call forms, masks, tolerances, controls) runs without a GPU. On CPU torch the
kernels library needs ``torch.version.cuda`` set to pick the torch-cuda variant (a test-only workaround, see
tests/packaging/hubtools.py).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import sys
import traceback
from pathlib import Path

import torch

if torch.version.cuda is None:  # test-only: lets kernels pick the torch-cuda variant on CPU torch (hubtools.py)
    torch.version.cuda = "12.8"

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import modeling_flash_attention_utils as mfau  # noqa: E402

FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss")
# The families whose sdpa path is exact enough and allowed (Gemma 2 and gpt-oss only support eager/flash/flex).
REFERENCE_IMPL = {"llama": "sdpa", "qwen2": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}
SEQ = 96          # > every sliding window below, so windows really cut
WINDOW = 24


def make_config(family: str):
    """Small random configs. initializer_range 0.1 gives peaked attention rows, so masks, softcap and sinks change
    the logits far beyond bf16 noise (the scenarios measure that with a control)."""
    common = dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=1024, initializer_range=0.1,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                        num_key_value_heads=2, head_dim=64, **common)  # GQA 4:1
    if family == "qwen2":
        return transformers.Qwen2Config(hidden_size=448, intermediate_size=896, num_attention_heads=7,
                                        num_key_value_heads=1, use_sliding_window=False, **common)  # MQA, d=64
    if family == "mistral":
        return transformers.MistralConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, **common)
    if family == "gemma2":
        return transformers.Gemma2Config(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
                                         sliding_window=WINDOW, attn_logit_softcapping=10.0,
                                         final_logit_softcapping=None,
                                         layer_types=["sliding_attention", "full_attention"], **common)
    if family == "gpt_oss":
        # every token uses both experts: no discrete routing choice that bf16 noise could flip
        return transformers.GptOssConfig(hidden_size=256, intermediate_size=256, num_attention_heads=8,
                                         num_key_value_heads=2, head_dim=64, num_local_experts=2,
                                         num_experts_per_tok=2, sliding_window=WINDOW,
                                         layer_types=["sliding_attention", "full_attention"], **common)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def control_config(family: str, cfg):
    """The same model with its attention feature switched off (the control that the comparison must not match)."""
    cfg = copy.deepcopy(cfg)
    if family == "mistral":
        cfg.sliding_window = None
    elif family == "gemma2":  # no softcap, and both layers full attention
        cfg.attn_logit_softcapping = None
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    else:
        return None
    return cfg


# -- gpt-oss: the workaround for transformers' compatibility list -------------------------------------------------
def allow_for_gpt_oss(repo: str) -> None:
    """gpt-oss lists the flash kernels it accepts (`_compatible_flash_implementations`) and replaces any other
    "flash" implementation by the first of them. Adding the repo to the list on the base class (the one that the
    inner GptOssModel shares) makes transformers keep it. Note: transformers then also skips the publisher trust
    check for it, as it does for every listed kernel."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssPreTrainedModel
    listed = list(GptOssPreTrainedModel._compatible_flash_implementations or [])
    if repo not in listed:
        GptOssPreTrainedModel._compatible_flash_implementations = [*listed, repo]


# -- spies and the reference kernel ----------------------------------------------------------------------------------
CALLS: list[dict] = []


FINITE_CHECK_MAX_NUMEL = 1 << 26  # larger tensors (a continuous-batching paged cache) are not scanned


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _finite(t):
    """Whether every element is finite; None where the harness must not look: under CUDA-graph capture (the read
    back is a sync, which invalidates the capture) and for tensors over FINITE_CHECK_MAX_NUMEL elements
    (transformers sizes its continuous-batching paged cache to 90% of free memory: a scan of it went out of memory
    on an H100, and its unused pages hold whatever the allocator left)."""
    if not t.is_floating_point() or t.numel() > FINITE_CHECK_MAX_NUMEL or (t.is_cuda and _capturing()):
        return None
    return bool(torch.isfinite(t).all())


def _layout(t):
    """Shape, strides, storage offset and finiteness of a tensor handed to the kernel (what a layout bug needs)."""
    if not isinstance(t, torch.Tensor):
        return None
    return {"shape": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset(),
            "contiguous": t.is_contiguous(), "finite": _finite(t)}


def _describe(name, args, kwargs):
    q = args[0]
    window = kwargs.get("window_size")
    sink = kwargs.get("learnable_sink", kwargs.get("s_aux"))
    if name == "varlen":
        sq = kwargs.get("max_seqlen_q")
        sq = int(sq) if sq is not None else None
    else:
        sq = int(q.shape[1])
    k = args[1] if len(args) > 1 else kwargs.get("k", kwargs.get("k_cache"))
    return {"fn": name, "keys": sorted(kwargs), "sq": sq, "q_shape": list(q.shape), "q_dtype": str(q.dtype),
            "k_dtype": str(getattr(k, "dtype", None)),
            "k_layout": _layout(k), "v_layout": _layout(args[2] if len(args) > 2 else kwargs.get("v", kwargs.get("v_cache"))),
            "q_layout": _layout(q),
            "causal": kwargs.get("causal"), "window_size": list(window) if window is not None else None,
            "softcap": kwargs.get("softcap"), "sink_dtype": str(sink.dtype) if sink is not None else None,
            "sink_requires_grad": bool(sink is not None and sink.requires_grad)}


def _spy(name, fn):
    def spy(*args, **kwargs):
        CALLS.append(_describe(name, args, kwargs))
        out = fn(*args, **kwargs)
        o = out[0] if isinstance(out, tuple) else out
        CALLS[-1]["out_finite"] = _finite(o) if isinstance(o, torch.Tensor) else None  # a sync; never in capture
        return out
    spy.__signature__ = inspect.signature(fn)
    return spy


def _reference():
    """tests/reference.py's attention_ref: this file runs as a script from tests/packaging/, so the folder above
    goes on sys.path first."""
    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from reference import attention_ref
    return attention_ref


def _ref_dense(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
               softcap=0.0, dropout_p=0.0, deterministic=False, **rest):
    attention_ref = _reference()
    if dropout_p:
        raise ValueError("the reference kernel has no dropout")
    out, lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window=tuple(window_size),
                             softcap=softcap or 0.0, sink=learnable_sink)
    return out, lse


def _ref_varlen(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                dropout_p=0.0, deterministic=False, **rest):
    attention_ref = _reference()
    if dropout_p:
        raise ValueError("the reference kernel has no dropout")
    outs = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, _ = attention_ref(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                             softmax_scale=softmax_scale, causal=causal, window=tuple(window_size),
                             softcap=softcap or 0.0, sink=learnable_sink)
        outs.append(o[0])
    out = torch.cat(outs)
    if out.shape[0] < q.shape[0]:  # rows past cu_seqlens_q[-1] (continuous batching pads q)
        out = torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])
    return out, None


def _ref_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None, page_table=None,
                 block_table=None, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                 learnable_sink=None, num_splits=0, return_softmax_lse=False, max_seqlen_q=None, **rest):
    """flash_attn_with_kvcache in plain PyTorch (dense q (B, Sq, H, D)): append k/v at cache_seqlens, then attend
    over the first cache_seqlens + Sq_new keys of each sequence (paged through the block table, or row b)."""
    attention_ref = _reference()
    pages = page_table if page_table is not None else block_table
    batch, ps = q.shape[0], k_cache.shape[1]
    seqlens = cache_seqlens
    if isinstance(seqlens, int):
        seqlens = torch.full((batch,), seqlens, dtype=torch.int32)
    outs = []
    for b in range(batch):
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        capacity = pages.shape[1] * ps if pages is not None else k_cache.shape[1]
        n0 = int(seqlens[b]) if seqlens is not None else capacity
        s_new = 0 if k is None else k.shape[1]
        pos = torch.arange(n0 + s_new, device=q.device)
        where = (pages[b, pos // ps].long(), pos % ps) if pages is not None else (row, pos)
        if s_new:
            new = pos[n0:]
            at = (pages[b, new // ps].long(), new % ps) if pages is not None else (row, new)
            k_cache[at], v_cache[at] = k[b], v[b]
        o, _ = attention_ref(q[b:b + 1], k_cache[where][None], v_cache[where][None], softmax_scale=softmax_scale,
                             causal=causal, window=tuple(window_size), softcap=softcap or 0.0, sink=learnable_sink)
        outs.append(o)
    out = torch.cat(outs)
    return (out, None) if return_softmax_lse else out


def install_spies(repo: str, reference_kernel: bool) -> dict:
    """Check that transformers holds the bundle's functions, then wrap them (or the reference) in spies."""
    varlen = mfau._flash_varlen_fn
    if varlen is None:
        raise AssertionError(f"transformers holds no flash_attn_varlen_func for {repo}")
    bundle = sys.modules[varlen.__module__.rsplit(".", 1)[0]]
    info = {"bundle_name": bundle.__name__, "bundle_file": bundle.__file__,
            "varlen_is_bundle": varlen is getattr(bundle, "flash_attn_varlen_func", None),
            "dense_is_bundle": mfau._flash_fn is getattr(bundle, "flash_attn_func", None),
            "bundle_has_kvcache": hasattr(bundle, "flash_attn_with_kvcache"),
            "transformers_has_kvcache": mfau._flash_with_kvcache_fn is not None,
            "loaded_implementation": mfau._loaded_implementation}
    dense, var = (_ref_dense, _ref_varlen) if reference_kernel else (mfau._flash_fn, varlen)
    mfau._flash_fn = _spy("dense", dense)
    mfau._flash_varlen_fn = _spy("varlen", var)
    if mfau._flash_with_kvcache_fn is not None:
        kv = _ref_kvcache if reference_kernel else mfau._flash_with_kvcache_fn
        mfau._flash_with_kvcache_fn = _spy("kvcache", kv)
    return info


# -- models ------------------------------------------------------------------------------------------------------
def attn_impls(model) -> list[str]:
    """The implementation every attention-bearing module would use (they read module.config)."""
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.add(cfg._attn_implementation)
    return sorted(seen)


def from_config(cfg, impl, dtype, allow_all_kernels=False):
    """``from_config`` on a deep copy of `cfg`. In transformers 5.22.2 ``from_pretrained`` takes
    ``allow_all_kernels=True`` but ``from_config`` passes it on to the model's __init__ (TypeError): there the
    context manager ``allow_all_hub_kernels()`` does the same."""
    from contextlib import nullcontext

    from transformers.integrations.hub_kernels import allow_all_hub_kernels
    with allow_all_hub_kernels() if allow_all_kernels else nullcontext():
        return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)


def build(cfg, impl, dtype, device, state=None, allow_all_kernels=False):
    """A model from its own deep copy of `cfg`; with `state`, the weights of another model (cast to `dtype`)."""
    torch.manual_seed(0)
    model = from_config(cfg, impl, dtype, allow_all_kernels)
    if state is not None:
        model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return model.to(device).eval()


def load_models(args, device):
    """ours: bf16 through the kernel repo; ref: bf16 through transformers' sdpa/eager; gold: fp32 eager, the
    yardstick both are measured against. All three share the weights (ours' random init)."""
    cfg = make_config(args.family)
    if args.family == "gpt_oss" and not args.no_workaround:
        allow_for_gpt_oss(args.repo)
    ours = build(cfg, args.repo, torch.bfloat16, device, allow_all_kernels=args.allow_all_kernels)
    state = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    ref = build(cfg, REFERENCE_IMPL[args.family], torch.bfloat16, device, state)
    gold = build(cfg, "eager", torch.float32, device, state)
    info = {"ours_impl": attn_impls(ours), "ref_impl": attn_impls(ref), "gold_impl": attn_impls(gold),
            "configs_shared": ours.config is ref.config, "transformers": transformers.__version__}
    return cfg, (ours, ref, gold), state, info


def judge(o, r, g, prefix=""):
    """Relative L2 errors: ours and ref against the fp32 gold, and ours against ref."""
    return {f"{prefix}err_ours": rel(o, g), f"{prefix}err_ref": rel(r, g), f"{prefix}err_pair": rel(o, r),
            f"{prefix}max_abs_pair": float((o.float() - r.float()).abs().max()),
            f"{prefix}finite": bool(torch.isfinite(o).all()), f"{prefix}finite_ref": bool(torch.isfinite(r).all())}


def inputs(cfg, device, padded: bool, batch: int = 3, seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:  # left padding, a different amount per row; row 0 unpadded
        for b in range(1, batch):
            pad = 7 * b + 3
            ids[b, :pad] = cfg.pad_token_id
            mask[b, :pad] = 0
    return ids.to(device), mask.to(device)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- scenarios ------------------------------------------------------------------------------------------------------
def scenario_forward(args, device):
    """Logits of a dense batch (flash_attn_func) and of a left-padded batch (flash_attn_varlen_func)."""
    cfg, (ours, ref, gold), state, info = load_models(args, device)
    spy = install_spies(args.repo, args.reference_kernel)
    ctl_cfg = control_config(args.family, cfg)
    if args.family == "gpt_oss":  # control: the same weights with the sinks pushed to -inf (no sink)
        ctl = build(cfg, "eager", torch.float32, device,
                    {k: (torch.full_like(v, -1e4) if k.endswith(".sinks") else v) for k, v in state.items()})
    else:
        ctl = None if ctl_cfg is None else build(ctl_cfg, "eager", torch.float32, device, state)
    out = {**info, **spy}
    for case in ("dense", "padded"):
        CALLS.clear()
        ids, mask = inputs(cfg, device, case == "padded")
        valid = mask.bool()
        with torch.no_grad():
            lo, lr, lg = (m(ids, attention_mask=mask).logits[valid] for m in (ours, ref, gold))
            res = judge(lo, lr, lg)
            if ctl is not None:
                res["control_err"] = rel(ctl(ids, attention_mask=mask).logits[valid], lg)
        out[case] = {**res, "calls": list(CALLS)}
    return out


def scenario_train(args, device):
    """One training step: loss and every parameter's gradient, ours and ref against the fp32 gold."""
    cfg, (ours, ref, gold), state, info = load_models(args, device)
    spy = install_spies(args.repo, args.reference_kernel)
    ids, mask = inputs(cfg, device, args.padded)
    labels = ids.masked_fill(mask == 0, -100)
    losses, grads = {}, {}
    for name, model in (("ours", ours), ("ref", ref), ("gold", gold)):
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses[name] = float(out.loss)
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    per_param, missing = {}, []
    for n, gg in grads["gold"].items():
        go, gr = grads["ours"][n], grads["ref"][n]
        if gg is None or go is None or gr is None:
            if not (gg is None and go is None and gr is None):
                missing.append(n)
            continue
        if float(gg.norm()) == 0.0:
            continue
        per_param[n] = (rel(go, gg), rel(gr, gg))
    # all gradients as one vector, and each attention parameter (q/k/v/o projections, sinks) on its own
    flat = {k: torch.cat([grads[k][n].float().flatten() for n in per_param]) for k in grads}
    attn = {n: e for n, e in per_param.items() if any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "sinks"))}
    worst = max(attn, key=lambda n: attn[n][0] - 1.5 * attn[n][1])
    return {**info, **spy, "loss_ours": losses["ours"], "loss_ref": losses["ref"], "loss_gold": losses["gold"],
            "grad_err_ours": rel(flat["ours"], flat["gold"]), "grad_err_ref": rel(flat["ref"], flat["gold"]),
            "worst_attn_param": worst, "worst_attn_err_ours": attn[worst][0], "worst_attn_err_ref": attn[worst][1],
            "n_grads": len(per_param), "n_attn_grads": len(attn),
            "sink_grads": sorted(n for n in per_param if n.endswith(".sinks")), "missing_grads": missing,
            "calls": CALLS}


def greedy_gaps(logits, toks):
    """How far each greedy token ``toks`` (B, steps) lies below the best of ``logits`` (B, steps, V) at its step, in
    units of that step's logit std (0: the argmax)."""
    return (logits.max(-1).values - logits.gather(-1, toks[..., None])[..., 0]) / logits.std(-1)


def greedy_check(ref, seqs, prompt_lens, gen_tokens, masks=None):
    """Teacher forcing: the reference model's logits at every generated position, and how far each generated token
    is below the reference's best (0 when it is the reference's argmax), in units of the logits' std."""
    worst_gap, mismatches, steps = 0.0, 0, 0
    with torch.no_grad():
        for b, seq in enumerate(seqs):
            x = torch.tensor([seq], device=next(ref.parameters()).device)
            logits = ref(x).logits[0].float()
            p = prompt_lens[b]
            for i, tok in enumerate(gen_tokens[b]):
                row = logits[p - 1 + i]
                gap = float((row.max() - row[tok]) / row.std())
                worst_gap = max(worst_gap, gap)
                mismatches += int(int(row.argmax()) != tok)
                steps += 1
    return {"worst_gap": worst_gap, "argmax_mismatches": mismatches, "steps": steps}


def scenario_generate(args, device):
    cfg, (ours, ref, gold), state, info = load_models(args, device)
    spy = install_spies(args.repo, args.reference_kernel)
    ids, mask = inputs(cfg, device, args.padded, batch=3, seq=40)
    new = args.new_tokens
    with torch.no_grad():
        gen = ours.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            return_dict_in_generate=True, output_logits=True, pad_token_id=cfg.pad_token_id)
        step_logits = torch.stack(gen.logits, 1).float()  # (B, new, V): prefill, then new-1 decode steps
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype, device=device)], 1)
        p = ids.shape[1]
        ref_tf, gold_tf = (m(gen.sequences, attention_mask=full_mask).logits.float()[:, p - 1:-1] for m in (ref, gold))
        ref_gen = ref.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=cfg.pad_token_id)
    toks = gen.sequences[:, p:]
    gaps = greedy_gaps(gold_tf, toks)
    return {**info, **spy, **judge(step_logits, ref_tf, gold_tf), "worst_gap": float(gaps.max()),
            "argmax_mismatches": int((gold_tf.argmax(-1) != toks).sum()),
            "same_tokens_as_ref_generate": bool(torch.equal(ref_gen, gen.sequences)),
            "generated": int(toks.numel()), "calls": CALLS}


def _saturating_fp8(cache):
    """Make each layer of a ``QuantizedCache(backend="fp8")`` clamp to e4m3's range before its cast.  transformers
    5.22.2 freezes the per-tensor scale at the first update and casts later states with it unclamped
    (``Fp8QuantizedLayer._quantize``), so a decode state beyond 448 x scale is stored as NaN (e4m3fn has no inf);
    the clamp is the saturating cast that cache would need, applied to ours and ref alike."""
    import types

    def quantize(layer, tensor, scale=None):
        if scale is None:
            scale = (tensor.abs().amax().float() / layer.fp8_max).clamp(min=torch.finfo(torch.float32).tiny)
        return (tensor.float() / scale).clamp(-layer.fp8_max, layer.fp8_max).to(layer.fp8_dtype), scale

    for layer in cache.layers:
        layer._quantize = types.MethodType(quantize, layer)
    return cache


def _cache_nan(cache) -> list[bool]:
    return [bool(torch.isnan(layer._quantized_keys[0].float()).any()
                 or torch.isnan(layer._quantized_values[0].float()).any()) for layer in cache.layers]


def scenario_generate_fp8_cache(args, device):
    """Greedy generate with transformers' FP8 KV cache (``QuantizedCache(backend="fp8")``), ours and ref each with
    their own such cache, so both read the same quantized keys and values.  That cache hands the attention
    dequantized states in the model's dtype (``Fp8QuantizedLayer.update``), so the bundle runs its bf16 kernels on
    them: transformers 5.22.2 has no call that passes an e4m3 cache to an attention kernel.

    Two passes: transformers' cache as it is (``raw_cache_nan``: which layers stored NaN, ours then ref; its
    unclamped cast stores NaN for a decode state beyond the first update's range, whichever attention runs), then
    the same cache with a saturating cast (``_saturating_fp8``), which is judged: step logits of ours against ref's
    (same cache) and against gold's teacher-forced logits of ours' tokens (no cache quantization)."""
    from transformers import QuantizedCache
    cfg, (ours, ref, gold), state, info = load_models(args, device)
    spy = install_spies(args.repo, args.reference_kernel)
    ids, mask = inputs(cfg, device, args.padded, batch=3, seq=40)
    new = args.new_tokens
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              return_dict_in_generate=True, output_logits=True, pad_token_id=cfg.pad_token_id)
    with torch.no_grad():
        raw = [QuantizedCache(backend="fp8", config=cfg) for _ in range(2)]
        ours.generate(ids, past_key_values=raw[0], **kw)
        ref.generate(ids, past_key_values=raw[1], **kw)
        raw_nan = _cache_nan(raw[0]) + _cache_nan(raw[1])
        CALLS.clear()  # the calls of the judged pass only
        caches = [_saturating_fp8(QuantizedCache(backend="fp8", config=cfg)) for _ in range(2)]
        gen = ours.generate(ids, past_key_values=caches[0], **kw)
        ref_gen = ref.generate(ids, past_key_values=caches[1], **kw)
        step, ref_step = (torch.stack(g.logits, 1).float() for g in (gen, ref_gen))
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype, device=device)], 1)
        p = ids.shape[1]
        gold_tf = gold(gen.sequences, attention_mask=full_mask).logits.float()[:, p - 1:-1]
        gold_ref = gold(ref_gen.sequences, attention_mask=full_mask).logits.float()[:, p - 1:-1]
    layer = caches[0].layers[0]
    toks, ref_toks = gen.sequences[:, p:], ref_gen.sequences[:, p:]
    # the same measure for ref's tokens on its own FP8 cache (recorded): how far the cache's quantization moves a
    # greedy path that no kernel of ours chose from gold's (which quantizes nothing)
    ref_gaps = greedy_gaps(gold_ref, ref_toks)
    # greedy paths of two bf16 implementations may part at a near tie; logits compare on the steps both took from
    # the same context (every step up to and including the first where a row's token differs)
    common = int((toks == ref_toks).all(0).long().cumprod(0).sum())
    k = min(common + 1, new)
    gaps = greedy_gaps(gold_tf, toks)
    return {**info, **spy, **judge(step[:, :k], ref_step[:, :k], gold_tf[:, :k]), "compared_steps": k,
            # the gap bar applies where ours and ref took the same context (the compared steps); past the step where
            # a row's greedy path parts from ref's, the quantized cache moves each path on its own (recorded only)
            "common_steps": common, "worst_gap": float(gaps[:, :k].max()), "worst_gap_all_steps": float(gaps.max()),
            "ref_worst_gap_all_steps": float(ref_gaps.max()), "generated": int(toks.numel()),
            "cache_layer": type(layer).__name__, "cache_storage_dtype": str(layer._quantized_keys[0].dtype),
            "raw_cache_nan": raw_nan, "cache_nan": _cache_nan(caches[0]) + _cache_nan(caches[1]),
            "calls": CALLS}


def scenario_generate_batch(args, device):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.utils.generic import is_flash_attention_requested
    cfg, (ours, ref, gold), state, info = load_models(args, device)
    spy = install_spies(args.repo, args.reference_kernel)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    new = args.new_tokens
    gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=cfg.pad_token_id)
    cb_kw = {} if args.cuda_graph == "default" else {"use_cuda_graph": args.cuda_graph == "on"}
    cb_cfg = ContinuousBatchingConfig(**cb_kw)
    outs = ours.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                               progress_bar=False)
    results = list(outs.values())
    errors = [r.error for r in results if r.error is not None]
    gen_tokens = [list(r.generated_tokens) for r in results]
    prompt_ids = [list(r.prompt_ids) for r in results]
    check = greedy_check(gold, [p + t for p, t in zip(prompt_ids, gen_tokens)], [len(p) for p in prompt_ids],
                         gen_tokens)
    return {**info, **spy, **check, "n_results": len(results), "n_prompts": len(prompts), "errors": errors,
            "lengths": [len(t) for t in gen_tokens], "new_tokens": new,
            "prompts_match": prompt_ids == prompts,
            "ours_impl_after": ours.config._attn_implementation,
            "fast_path_name_match": is_flash_attention_requested(ours.config, version=[2, 3]),
            "calls": CALLS}


def scenario_select(args, device):
    """Only the selection path (no forward): which implementation transformers kept, and what it will pass."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    cfg = make_config(args.family)
    if args.family == "gpt_oss" and not args.no_workaround:
        allow_for_gpt_oss(args.repo)
    model = from_config(cfg, args.repo, torch.bfloat16, args.allow_all_kernels)
    spy = install_spies(args.repo, reference_kernel=True)
    process = mfau._process_flash_kwargs_fn
    supports = process.keywords["supports_mapping"] if hasattr(process, "keywords") else {}
    impl = model.config._attn_implementation
    return {**spy, "impl": attn_impls(model), "registered": impl in ALL_ATTENTION_FUNCTIONS.valid_keys(),
            "supports": supports, "transformers": transformers.__version__}


SCENARIOS = {"forward": scenario_forward, "train": scenario_train, "generate": scenario_generate,
             "generate_fp8_cache": scenario_generate_fp8_cache,
             "generate_batch": scenario_generate_batch, "select": scenario_select}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--repo", required=True)
    p.add_argument("--family", default="llama", choices=FAMILIES)
    p.add_argument("--padded", action="store_true")
    p.add_argument("--reference-kernel", action="store_true")
    p.add_argument("--allow-all-kernels", action="store_true")
    p.add_argument("--no-workaround", action="store_true", help="gpt-oss: do not add the repo to its list")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--cuda-graph", choices=("default", "on", "off"), default="default")
    args = p.parse_args(argv)
    device = "cpu" if args.reference_kernel else "cuda"
    try:
        result = {"ok": True, **SCENARIOS[args.scenario](args, device)}
    except Exception as e:  # reported to the parent test, which prints it
        result = {"ok": False, "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(),
                  "calls": CALLS}
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
