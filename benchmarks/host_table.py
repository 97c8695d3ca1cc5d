"""Markdown rendering of benchmarks/bench_host.py results (per-call host cost), for the README generator.

    from benchmarks.host_table import bench_host_section
    text = bench_host_section("benchmarks/results/host_h100.jsonl")

Plain Python (json only): no torch, no GPU.  The pair/target definitions live here so the benchmark and the table
agree on them.
"""

from __future__ import annotations

import json
from pathlib import Path

# (pair key, label, our method, SDPA FLASH method, flash-attn-4 SM120 method, baseline-module method)
PAIRS = (
    ("dense_fwd", "dense forward", "ours_dense_fwd", "sdpa_flash_fwd", "fa4_sm120_dense_fwd", "base_dense_fwd"),
    ("varlen_fwd", "varlen forward (vs dense SDPA)", "ours_varlen_fwd", "sdpa_flash_fwd", "fa4_sm120_varlen_fwd",
     "base_varlen_fwd"),
    ("fwd_bwd", "forward + backward", "ours_fwd_bwd", "sdpa_flash_fwd_bwd", "fa4_sm120_fwd_bwd", "base_fwd_bwd"),
)

# ratio = ours µs / peer µs, lower is better; a target is met when ratio <= max
TARGETS = {
    "ours_vs_sdpa_flash": 1.5,
    "ours_vs_fa4_sm120": 0.5,
}

METHOD_LABELS = {
    "ours_dense_fwd": "ours, dense forward",
    "ours_varlen_fwd": "ours, varlen forward (max_seqlen given)",
    "ours_fwd_bwd": "ours, forward + backward",
    "base_dense_fwd": "baseline module, dense forward",
    "base_varlen_fwd": "baseline module, varlen forward",
    "base_fwd_bwd": "baseline module, forward + backward",
    "sdpa_flash_fwd": "SDPA FLASH (FA2), forward",
    "sdpa_flash_fwd_bwd": "SDPA FLASH (FA2), forward + backward",
    "fa4_sm120_dense_fwd": "flash-attn-4 b36 SM120 path, dense forward",
    "fa4_sm120_varlen_fwd": "flash-attn-4 b36 SM120 path, varlen forward",
    "fa4_sm120_fwd_bwd": "flash-attn-4 b36 SM120 path, forward + backward",
}


def load_rows(results_path) -> tuple[list[dict], dict | None]:
    """(method rows, summary row or None) of a bench_host.py JSONL file."""
    methods, summary = [], None
    for line in Path(results_path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        row = json.loads(line)
        if row.get("kind") == "summary":
            summary = row
        elif row.get("kind") == "method":
            methods.append(row)
    return methods, summary


def _us(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _met(x) -> str:
    return "–" if x is None else ("yes" if x else "**no**")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def bench_host_section(results_path) -> str:
    """A markdown section: one table of µs per call per method, one of ratios against the targets."""
    path = Path(results_path)
    if not path.exists():
        return f"_No host-cost results yet ({path.as_posix()} is missing; run benchmarks/bench_host.py --out ...)._\n"
    methods, summ = load_rows(path)
    summ = summ or {}
    prob = summ.get("problem", {})
    out = []
    head = "Host cost per call"
    if prob:
        head += (f" (B={prob.get('batch')}, S={prob.get('seqlen')}, Hq {prob.get('hq')} / Hkv {prob.get('hkv')}, "
                 f"d{prob.get('head_dim')}, {prob.get('dtype')}, {'causal' if prob.get('causal') else 'non-causal'}")
        head += f", {summ.get('calls')} calls back to back, median of {summ.get('reps')} repetitions)"
    out.append(head + (f" on {summ['device']}, torch {summ.get('torch')}" if summ.get("device") else "") + ":")
    out.append("")
    out.append("| method | µs / call | host µs / call (before the final sync) |")
    out.append("|---|---|---|")
    for r in methods:
        label = METHOD_LABELS.get(r["method"], r["method"])
        if r.get("error"):
            out.append(f"| {label} | failed: {_cell(r['error'][:120])} | – |")
        else:
            out.append(f"| {label} | {_us(r.get('us_per_call'))} | {_us(r.get('host_us_per_call'))} |")
    ratios = summ.get("ratios", {})
    met = summ.get("targets_met", {})
    if ratios:
        new_old = ratios.get("new_vs_old") or {}
        out.append("")
        cols = ["pair",
                f"ours / SDPA FLASH (target ≤ {TARGETS['ours_vs_sdpa_flash']}×)", "met",
                f"ours / flash-attn-4 SM120 (target ≤ {TARGETS['ours_vs_fa4_sm120']}×)", "met"]
        if new_old:
            cols.append(f"new / old ({summ.get('baseline_module')})")
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for key, label, *_ in PAIRS:
            cells = [label,
                     _ratio(ratios.get("ours_vs_sdpa_flash", {}).get(key)),
                     _met(met.get("ours_vs_sdpa_flash", {}).get(key)),
                     _ratio(ratios.get("ours_vs_fa4_sm120", {}).get(key)),
                     _met(met.get("ours_vs_fa4_sm120", {}).get(key))]
            if new_old:
                cells.append(_ratio(new_old.get(key)))
            out.append("| " + " | ".join(cells) + " |")
        if summ.get("all_targets_met") is not None:
            out.append("")
            out.append(f"All measured targets met: {'yes' if summ['all_targets_met'] else '**no**'}.")
    for note in summ.get("notes", []):
        out.append("")
        out.append(f"Note: {note}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    print(bench_host_section(sys.argv[1]), end="")
