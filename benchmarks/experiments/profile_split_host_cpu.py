"""What a split decode call does on the host beyond an unsplit one, counted on the CPU (issue 31, item 3): the
device, the compiler and the launches stubbed (tests/plan_grid.py), one decode call as transformers makes it
(q (1, 1, 32, 128), k/v (1, L, 8, 128) bf16 viewed from a (1, 8, L, 128) cache, causal; the KV growing a row per
step) through flash_attn_func and flash_attn_with_kvcache, num_splits=1 against the automatic split, under cProfile.
Counts are deterministic (timings on a shared CPU are not, and a stubbed launch costs nothing): function calls per
call, and every function (torch ops included) the split path calls more often than the unsplit one.

    python benchmarks/experiments/profile_split_host_cpu.py [--package-root DIR] [--json FILE]

``--package-root``: a directory holding torch-ext/ of another commit (``git archive <commit> torch-ext | tar -x -C
DIR``), to count the same for it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package-root", type=Path, default=ROOT)
    ap.add_argument("--kv", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(a.package_root / "torch-ext"))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import plan_grid
    import flash_attn_4_sm120 as fa

    calls, counts = [], {}
    cases = {
        "func_1": lambda q, k: fa.flash_attn_func(q, k, k, causal=True, num_splits=1),
        "func_split": lambda q, k: fa.flash_attn_func(q, k, k, causal=True, num_splits=0),
        "kvcache_1": lambda q, k: fa.flash_attn_with_kvcache(q, k, k, num_splits=1),
        "kvcache_split": lambda q, k: fa.flash_attn_with_kvcache(q, k, k, num_splits=0),
    }
    with plan_grid.stubbed(True, calls), torch.no_grad():
        cache = torch.zeros(1, 8, a.kv + a.steps, 128, dtype=torch.bfloat16)
        q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
        for name, fn in cases.items():
            def loop():
                for s in range(a.steps):
                    fn(q, cache[:, :, : a.kv + s].transpose(1, 2))
            loop()  # warm: plans, memos
            calls.clear()
            pr = cProfile.Profile()
            pr.enable()
            loop()
            pr.disable()
            per = {}
            for (file, _, func), (_, ncalls, _, _, _) in pstats.Stats(pr).stats.items():
                if file == __file__:
                    continue
                label = func if file == "~" else f"{Path(file).name}:{func}"
                per[label] = per.get(label, 0) + ncalls / a.steps
            counts[name] = per
            counts[name + "/launches"] = len(calls) / a.steps
    rows = []
    for base, split in (("func_1", "func_split"), ("kvcache_1", "kvcache_split")):
        b, s = counts[base], counts[split]
        extra = {k: round(s.get(k, 0) - b.get(k, 0), 2) for k in sorted(set(b) | set(s))
                 if abs(s.get(k, 0) - b.get(k, 0)) > 1e-9}
        rows.append({"package": str(a.package_root), "kv": a.kv, "unsplit": base, "split": split,
                     "calls_per_call": [round(sum(b.values()), 1), round(sum(s.values()), 1)],
                     "launches_per_call": [counts[base + "/launches"], counts[split + "/launches"]],
                     "extra_in_split": dict(sorted(extra.items(), key=lambda kv: (-kv[1], kv[0])))})
        print(json.dumps(rows[-1], indent=1))
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
