"""Where the deterministic backward's time goes (issue 30 item 2; a tuning aid, not the peer benchmark): the relay
form (kernels/dq_relay.py) timed beside copies of itself with one part of the ordering taken out
(``dq_relay.RELAY_PROBE``: "relaxed" passes turns without the release fence, "nowait" skips the waits, "free"
both: the descending walk and the counter traffic alone), the default fused backward and the atomic-free pair.

    python benchmarks/experiments/probe_relay_cost.py [--dims 64 128] [--seqlens 1024 4096] [--rounds 3] [--out F]

``--dims``: the head dims whose relay is timed; a dim not in config_bwd.RELAY_HEAD_DIMS (d128) is added for the
run, so its relay runs on the default fused tile (the d128 2 x 4 dK/dV grid).  The probe variants break the
ordering, so only "relay" is checked: bitwise-equal gradients on a second run and agreement with the pair to fp32
rounding (the row records both).  Each variant's kernels are compiled once and swapped into jit's memory cache
(the disk cache and the prebuilt set are off: the probe switch is not part of the compile key).  Every round times
every variant (CUDA-event medians after warm-up, bench_fwd.time_fn) of the backward alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["FA4_SM120_DISK_CACHE"] = "0"
os.environ["FA4_SM120_PREBUILT"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fwd import SHAPES, append_jsonl, flops, time_fn  # noqa: E402

VARIANTS = ("default", "relay", "relaxed", "nowait", "free", "pair")
CELLS = {64: ("mha-d64", 16, 16), 128: ("llama3-8b", 32, 8)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", nargs="*", type=int, default=[64, 128])
    ap.add_argument("--seqlens", nargs="*", type=int, default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd, jit
    from flash_attn_4_sm120.kernels import dq_relay

    config_bwd.RELAY_HEAD_DIMS = frozenset(config_bwd.RELAY_HEAD_DIMS | set(args.dims))
    probe_of = {"relay": None, "relaxed": "relaxed", "nowait": "nowait", "free": "free"}
    memory = {p: {} for p in probe_of.values()}
    real_fused_plan = dispatch_bwd.fused_plan
    state = {"probe": None}

    def set_variant(variant: str):
        probe = probe_of.get(variant, None)
        if probe != state["probe"]:
            memory[state["probe"]].update(jit._MEMORY)
            dq_relay.RELAY_PROBE = probe
            state["probe"] = probe
            jit._MEMORY.clear()
            dispatch_bwd.clear_caches()
            jit._MEMORY.update(memory[probe])
        dispatch_bwd.fused_plan = (lambda plan, device, relay=False: None) if variant == "pair" else real_fused_plan

    rows = []
    try:
        for d in args.dims:
            name, hq, hkv = CELLS.get(d, (f"mha-d{d}", 16, 16))
            for s in args.seqlens:
                b = max(1, args.tokens // s)
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(s + d)
                    mk = lambda n, h: torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                                  generator=g).requires_grad_()
                    q, k, v = mk(s, hq), mk(s, hkv), mk(s, hkv)
                    gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    outs = {det: fa.flash_attn_func(q, k, v, causal=causal, deterministic=det)[0]
                            for det in (False, True)}

                    def call(variant):
                        out = outs[variant not in ("default",)]
                        return torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)

                    row = dict(shape=name, hq=hq, hkv=hkv, d=d, seqlen=s, batch=b, causal=causal,
                               device=torch.cuda.get_device_name())
                    grads = {}
                    for variant in VARIANTS:
                        set_variant(variant)
                        grads[variant] = call(variant)
                    set_variant("relay")
                    again = call("relay")
                    row["relay_bitwise"] = all(torch.equal(a, c) for a, c in zip(grads["relay"], again))
                    row["relay_vs_pair_maxdiff"] = max(
                        (a.float() - c.float()).abs().max().item() for a, c in zip(grads["relay"], grads["pair"]))
                    row["pair_maxabs"] = max(c.float().abs().max().item() for c in grads["pair"])
                    times = {v: [] for v in VARIANTS}
                    for _ in range(args.rounds):
                        for variant in VARIANTS:
                            set_variant(variant)
                            times[variant].append(time_fn(lambda: call(variant)))
                    fl = 2.5 * flops(b, hq, s, d, causal)
                    for variant in VARIANTS:
                        ms = statistics.median(times[variant])
                        row[f"{variant}_ms"] = round(ms, 4)
                        row[f"{variant}_tflops"] = round(fl / ms / 1e9, 1)
                        row[f"{variant}_vs_default"] = round(row["default_ms"] / ms, 3)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    append_jsonl(args.out, [row])
    finally:
        set_variant("default")
    return 0


if __name__ == "__main__":
    sys.exit(main())
