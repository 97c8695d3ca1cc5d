"""Greedy ``generate`` through Hugging Face transformers (5.22.2) with the bundle, tokens per second: the default
split count (``num_splits=None``: automatic for inference calls), no split (the release before it, forced through
``splitkv.DEFAULT_SPLITS_AUTO = False`` on the loaded bundle), and transformers' SDPA, in one process.

    python benchmarks/bench_generate.py                      # 4K and 16K context, 2 layers, 128 new tokens
    python benchmarks/bench_generate.py --layers 4 --contexts 4096 16384 --new-tokens 256

The model is Llama-3-8B-shaped (hidden 4096, 32 query heads, 8 KV heads, head dim 128, FFN 14336, vocab 128256)
with random weights and a few layers; batch 1, bf16, a DynamicCache (the default).  transformers loads the bundle
itself, as a user's ``attn_implementation="org/repo"`` does: the committed build/torch-cuda is served by the test
suite's local hub (tests/packaging/hub_server.py), so nothing is downloaded.

Per (context, implementation): the prompt is random token ids of that length; ``generate(max_new_tokens=1)``
(prefill + one step) and ``generate(max_new_tokens=1 + N)`` are timed (CUDA-synchronised wall clock, median of
``--repeats``), and the decode rate is N / (t(1 + N) - t(1)) tokens/s; the end-to-end rate (1 + N) / t(1 + N) is
recorded too.  The three implementations run interleaved per repeat, so clock drift hits them alike.  Each row also
says whether its greedy tokens equal the SDPA model's (bf16 ties can differ; reported, not asserted).

Writes one JSON line per (context, implementation) to benchmarks/results/generate_<device>.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "packaging"))
REPO = "kernels-test/flash-attn-4-sm120"  # the test hub's trusted org (tests/packaging/hubtools.py)


def device_tag(name: str) -> str:
    """Short file tag of a GPU name: h100, h200, rtx5090, ... (else the name, lower-case, non-alphanumerics as _)."""
    m = re.search(r"(h100|h200|a100|b200|gb10|l40s?|l4|rtx ?pro ?6000|rtx ?\d{4})", name.lower())
    return re.sub(r"\W+", "", m.group(1)) if m else re.sub(r"\W+", "_", name.lower()).strip("_")


def llama3_8b_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001, pad_token_id=128001)


def build(cfg, impl: str, state=None):
    """A bf16 CUDA model of ``cfg`` (a deep copy: transformers records the implementation on the config object),
    with ``state``'s weights when given."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.hub_kernels import allow_all_hub_kernels

    with allow_all_hub_kernels():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def bundle_splitkv():
    """The loaded bundle's splitkv module (found from the function transformers took from it)."""
    from transformers import modeling_flash_attention_utils as mfau

    fn = mfau._flash_fn or mfau._flash_varlen_fn
    if fn is None or not fn.__module__.endswith(".interface"):
        raise RuntimeError(f"transformers did not load the bundle's functions (got {fn!r})")
    return importlib.import_module(fn.__module__.rsplit(".", 1)[0] + ".splitkv")


def timed_generate(model, ids, new_tokens: int):
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, ids.shape[1]:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/generate_<device>.jsonl")
    args = ap.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    from hub_server import LocalHub  # the test suite's local hub (serves build/torch-cuda)
    from hubtools import isolated_env, seed_bundle

    (home / "hub").mkdir()
    hub = LocalHub(home / "hub")
    seed_bundle(hub.store, REPO)
    hub.start()
    try:
        # huggingface_hub and kernels read these at import: set before importing transformers
        env = isolated_env(home, endpoint=hub.endpoint)
        os.environ.clear()
        os.environ.update(env)
        return run(args)
    finally:
        hub.stop()


def run(args) -> int:
    import torch
    import transformers

    if not torch.cuda.is_available():
        print("bench_generate needs a CUDA GPU", file=sys.stderr)
        return 2
    dev_name = torch.cuda.get_device_name()
    out_path = args.out or ROOT / "benchmarks" / "results" / f"generate_{device_tag(dev_name)}.jsonl"
    cfg = llama3_8b_config(args.layers)
    torch.manual_seed(0)
    ref = build(cfg, "sdpa")
    state = ref.state_dict()
    ours = build(cfg, REPO, state)
    with torch.no_grad():  # transformers takes the bundle's functions on the first call
        ours(torch.ones(1, 16, dtype=torch.long, device="cuda"))
    splitkv = bundle_splitkv()
    impls = {"sdpa": (ref, None), "ours_default": (ours, True), "ours_no_split": (ours, False)}
    rows = []
    for ctx in args.contexts:
        g = torch.Generator(device="cuda").manual_seed(ctx)
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda", generator=g)
        for model, auto in impls.values():  # warm-up: compiles our kernels, fills caches
            if auto is not None:
                splitkv.DEFAULT_SPLITS_AUTO = auto
            timed_generate(model, ids, 1 + min(8, args.new_tokens))
        times = {name: ([], []) for name in impls}
        tokens = {}
        for _ in range(args.repeats):
            for name, (model, auto) in impls.items():
                if auto is not None:
                    splitkv.DEFAULT_SPLITS_AUTO = auto
                t1, _ = timed_generate(model, ids, 1)
                tn, toks = timed_generate(model, ids, 1 + args.new_tokens)
                times[name][0].append(t1)
                times[name][1].append(tn)
                tokens[name] = toks
        splitkv.DEFAULT_SPLITS_AUTO = True
        for name in impls:
            t1, tn = statistics.median(times[name][0]), statistics.median(times[name][1])
            row = dict(bench="generate", device=dev_name, transformers=transformers.__version__,
                       torch=torch.__version__, model="llama3-8b-shaped", layers=args.layers, batch=1, context=ctx,
                       new_tokens=args.new_tokens, impl=name, prefill_s=round(t1, 4), total_s=round(tn, 4),
                       decode_tok_s=round(args.new_tokens / (tn - t1), 2), e2e_tok_s=round((1 + args.new_tokens) / tn, 2),
                       same_tokens_as_sdpa=bool(torch.equal(tokens[name], tokens["sdpa"])),
                       repeats=args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
