"""Regenerate (or --check) the README sections that come from code and committed results:

  <!-- features:begin --> ... <!-- features:end -->   support matrix from FEATURES (torch-ext/.../features.py)
  <!-- bench-fwd:begin --> ... <!-- bench-fwd:end -->  forward benchmark table from benchmarks/results/fwd_h100.jsonl
  <!-- bench-bwd:begin --> ... <!-- bench-bwd:end -->  backward table from benchmarks/results/bwd_h100.jsonl
  <!-- bench-host:begin --> ... <!-- bench-host:end --> per-call host cost from benchmarks/results/host_h100.jsonl
  <!-- bench-decode:begin --> ... <!-- bench-decode:end --> decode bandwidth from benchmarks/results/decode_h100.jsonl
  <!-- bench-dropout:begin --> ... <!-- bench-dropout:end --> dropout cost from benchmarks/results/dropout_h100.jsonl

    python scripts/readme_sections.py          # rewrite README.md
    python scripts/readme_sections.py --check  # exit 1 when README.md drifted (CI)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FWD_RESULTS = ROOT / "benchmarks" / "results" / "fwd_h100.jsonl"
BWD_RESULTS = ROOT / "benchmarks" / "results" / "bwd_h100.jsonl"
HOST_RESULTS = ROOT / "benchmarks" / "results" / "host_h100.jsonl"
DECODE_RESULTS = ROOT / "benchmarks" / "results" / "decode_h100.jsonl"
DROPOUT_RESULTS = ROOT / "benchmarks" / "results" / "dropout_h100.jsonl"
DROPOUT_RUNS = 3  # the README reports the last three bench_dropout runs


def _features_module():
    path = ROOT / "torch-ext" / "flash_attn_4_sm120" / "features.py"
    spec = importlib.util.spec_from_file_location("_fa4sm120_features", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def features_section() -> str:
    return _features_module().support_matrix_markdown()


def _fmt(x, nd=0):
    return "—" if x is None else f"{x:.{nd}f}"


def _seqlen_causal(r: dict) -> tuple[str, str]:
    """A benchmark row's S and causal columns (a chunked-prefill row: queries over keys, bottom-right)."""
    s = f"{r['seqlen']} over {r['seqlen_k']}" if r.get("seqlen_k") else f"{r['seqlen']}"
    causal = ("yes (bottom-right)" if r.get("seqlen_k") else "yes") if r["causal"] else "no"
    return s, causal


def bench_fwd_section() -> str:
    if not FWD_RESULTS.exists():
        return "_No forward benchmark committed yet._\n"
    rows = [json.loads(line) for line in FWD_RESULTS.read_text().splitlines() if line.strip()]
    cells = [r for r in rows if r.get("kind") != "summary"]
    summ = next((r for r in rows if r.get("kind") == "summary"), {})
    out = [
        f"Measured on {summ.get('device', '?')} (the SM120 proxy; SM120 limits kept), torch {summ.get('torch', '?')}, "
        "bf16, TFLOPS = 4·B·Hq·S²·D / time (halved when causal), median of CUDA-event timings after warm-up, "
        "B·S = 16384.",
        "",
        "| shape (Hq/Hkv/D) | S | causal | ours | SDPA FLASH (FA2) | flash-attn-4 SM120 path | cuDNN-fe SM80 "
        "| ours ÷ best peer | ours ÷ FA2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cells:
        s, causal = _seqlen_causal(r)
        out.append(
            f"| {r['shape']} {r['hq']}/{r['hkv']}/{r['d']} | {s} | {causal} "
            f"| {_fmt(r.get('ours_tflops'))} | {_fmt(r.get('sdpa_flash_tflops'))} | {_fmt(r.get('fa4_sm120_tflops'))} "
            f"| {_fmt(r.get('cudnn_sm80_tflops'))} | {_fmt(r.get('ratio_vs_best_peer'), 2)} "
            f"| {_fmt(r.get('ratio_vs_sdpa_flash'), 2)} |"
        )
    grid = [r for r in cells if not r.get("extra")]
    out += [
        "",
        f"Geomean over the {len(grid)}-cell grid: **{_fmt(summ.get('geomean_vs_best_peer'), 2)}×** the best peer per "
        f"cell (lowest cell {_fmt(summ.get('min_vs_best_peer'), 2)}), **{_fmt(summ.get('geomean_vs_sdpa_flash'), 2)}×** "
        f"SDPA FLASH, {_fmt(summ.get('geomean_vs_fa4_sm120'), 2)}× flash-attn-4 (SM120 path), "
        f"{_fmt(summ.get('geomean_vs_cudnn_sm80'), 2)}× cuDNN-frontend SM80; best cell "
        f"{_fmt(summ.get('best_cell_tflops'))} TFLOPS."
        + (f" The added cells (70B-class GQA, d=96, d=256 GQA, chunked prefill): "
           f"{_fmt(summ.get('extra_geomean_vs_best_peer'), 2)}× the best peer (lowest "
           f"{_fmt(summ.get('extra_min_vs_best_peer'), 2)}); SDPA's causal aligns top-left, so it has no chunked "
           "cell." if summ.get("extra_geomean_vs_best_peer") else ""),
    ]
    return "\n".join(out) + "\n"


def bench_bwd_section() -> str:
    if not BWD_RESULTS.exists():
        return "_No backward benchmark committed yet._\n"
    rows = [json.loads(line) for line in BWD_RESULTS.read_text().splitlines() if line.strip()]
    cells = [r for r in rows if r.get("kind") != "summary"]
    summ = next((r for r in rows if r.get("kind") == "summary"), {})
    out = [
        f"Backward only (dQ, dK, dV), {summ.get('device', '?')}, bf16, TFLOPS = 2.5 × the forward FLOPs / time.",
        "",
        "| shape (Hq/Hkv/D) | S | causal | ours | SDPA FLASH (FA2) | flash-attn-4 SM120 path | ours ÷ FA2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in cells:
        s, causal = _seqlen_causal(r)
        out.append(
            f"| {r['shape']} {r['hq']}/{r['hkv']}/{r['d']} | {s} | {causal} "
            f"| {_fmt(r.get('ours_tflops'))} | {_fmt(r.get('sdpa_flash_tflops'))} | {_fmt(r.get('fa4_sm120_tflops'))} "
            f"| {_fmt(r.get('ratio_vs_sdpa_flash'), 2)} |"
        )
    grid = [r for r in cells if not r.get("extra")]
    small = [r["ours_tflops"] / r["fa4_sm120_tflops"] for r in grid if r["d"] <= 128 and r.get("fa4_sm120_tflops")]
    small_geo = math.exp(sum(map(math.log, small)) / len(small)) if small else None
    out += [
        "",
        f"Geomean over the {len(grid)}-cell grid: {_fmt(summ.get('geomean_vs_sdpa_flash'), 2)}× SDPA FLASH "
        f"(weakest cell {_fmt(summ.get('weakest_cell_vs_sdpa_flash'), 2)}), "
        f"{_fmt(summ.get('geomean_vs_fa4_sm120'), 2)}× flash-attn-4 (SM120 path"
        + (f"; {_fmt(small_geo, 2)}× at d <= 128, its d256 backward being the slow one" if small_geo else "")
        + "); best cell "
        f"{_fmt(summ.get('best_cell_tflops'))} TFLOPS."
        + (f" The added cells (70B-class GQA, d=96, d=256 GQA): {_fmt(summ.get('extra_geomean_vs_sdpa_flash'), 2)}× "
           "SDPA FLASH." if summ.get("extra_geomean_vs_sdpa_flash") else "")
        + "".join(f" Chunked prefill ({r['seqlen']} queries over {r['seqlen_k']} keys, bottom-right; no like-for-like "
                  f"SDPA call): {_fmt(r.get('ratio_vs_best_peer'), 2)}× flash-attn-4 (SM120 path)."
                  for r in cells if r.get("seqlen_k")),
    ]
    return "\n".join(out) + "\n"


def bench_host_section() -> str:
    spec = importlib.util.spec_from_file_location("_fa4sm120_host_table", ROOT / "benchmarks" / "host_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bench_host_section(HOST_RESULTS)


def bench_decode_section() -> str:
    rows = [json.loads(line) for line in DECODE_RESULTS.read_text().splitlines() if line.strip()]
    cases = [r for r in rows if "case" in r]
    head = next((r for r in rows if "case" not in r), cases[0] if cases else {})
    out = [f"Decode over a KV cache (`flash_attn_with_kvcache`, bf16, Hq 32, q_len 1 unless noted) on "
           f"{head.get('device', '?')}: K+V bytes read per second, against a 1 GiB device-to-device copy in the same "
           f"process ({_fmt(head.get('copy_gbps'))} GB/s, bytes read + written); `num_splits=0` (automatic) and 1; "
           "flash-attn-4 4.0.0b36 with its SM120 path forced (no paged KV there). Medians of CUDA-event timings of "
           "CUDA-graph replays of one call (GPU time, what an engine that captures its decode step gets); the "
           "8-call column replays one graph of 8 calls, each over its own copy of the cache, per call (what an "
           "engine that captures a whole decode step, one call per layer, pays: the graph launch shared, no K/V "
           "left in L2 by the previous call); the eager column times back-to-back Python calls, which adds the "
           "host cost per call (on the lent machine's slow CPU) where that exceeds the GPU time.",
           "",
           "| case | B | KV len | Hkv | d | page | auto GB/s | % of copy | 8-call graph % of copy | 1 split GB/s "
           "| fa4 SM120 GB/s | auto ÷ fa4 | auto eager GB/s | eager ÷ fa4 eager |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cases:
        fa4 = r.get("fa4_sm120_gbps")
        spd = r.get("speedup_vs_fa4_sm120")
        spd_e = r.get("speedup_vs_fa4_sm120_eager")
        name = r["case"] + (f" (q_len {r['q_len']})" if r.get("q_len", 1) != 1 else "")
        pct = r.get("ours_auto_layers_pct_of_copy")
        layers = f"{100 * pct:.0f}%" if pct is not None else "-"
        out.append(f"| {name} | {r['batch']} | {r['kv_len']} | {r['hkv']} | {r['d']} | {r.get('page_size') or '-'} | "
                   f"{_fmt(r['ours_auto_gbps'])} | {100 * r['ours_auto_pct_of_copy']:.0f}% | {layers} | "
                   f"{_fmt(r['ours_split1_gbps'])} | {_fmt(fa4) if fa4 else '-'} | "
                   f"{f'{spd:.2f}x' if spd else '-'} | {_fmt(r.get('ours_auto_eager_gbps'))} | "
                   f"{f'{spd_e:.2f}x' if spd_e else '-'} |")
    return "\n".join(out) + "\n"


def bench_dropout_section() -> str:
    """The last DROPOUT_RUNS runs of bench_dropout.py with its default, alternating timing (each run: fwd/bwd x
    causal or not, appended in that order; rows of the sequential timing have ``timing`` "sequential" or none)."""
    rows = [json.loads(line) for line in DROPOUT_RESULTS.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("timing") == "alternating"]
    keys = sorted({(r["direction"], r["causal"]) for r in rows}, key=lambda k: (k[0] != "fwd", k[1]))
    last = rows[-DROPOUT_RUNS * len(keys):]
    head = last[0]
    out = [f"`python benchmarks/bench_dropout.py` on {head.get('device', '?')} (the SM120 proxy), torch "
           f"{head.get('torch', '?')}, bf16, d{head['head_dim']}, B={head['batch']}, {head['heads']} heads, "
           f"S={head['seqlen']}, p={head['dropout_p']}: time of the call without dropout ÷ time with it (issue 10 "
           f"asks >= {head['target']}), CUDA-event medians of the two calls timed in alternation, the last "
           f"{DROPOUT_RUNS} runs ({last[0]['time']} to {last[-1]['time']}); backward TFLOPS count 2.5x the forward "
           "FLOPs.",
           "",
           "| direction | causal | ms without | ms with | TFLOPS with | ratio (median) | runs |",
           "|---|---|---|---|---|---|---|"]
    for direction, causal in keys:
        sel = [r for r in last if (r["direction"], r["causal"]) == (direction, causal)]
        med = sorted(sel, key=lambda r: r["ratio"])[len(sel) // 2]
        runs = ", ".join(f"{r['ratio']:.3f}" for r in sel)
        out.append(f"| {direction} | {'yes' if causal else 'no'} | {med['ms_no_dropout']:.3f} | "
                   f"{med['ms_dropout']:.3f} | {med['tflops_dropout']:.0f} | {med['ratio']:.3f} | {runs} |")
    return "\n".join(out) + "\n"


SECTIONS = {"features": features_section, "bench-fwd": bench_fwd_section, "bench-bwd": bench_bwd_section,
            "bench-host": bench_host_section, "bench-decode": bench_decode_section,
            "bench-dropout": bench_dropout_section}


def render(text: str) -> str:
    for name, fn in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            raise SystemExit(f"README.md lacks the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{fn()}{end}{tail}"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    current = README.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md is out of date with FEATURES or benchmarks/results: run python scripts/readme_sections.py",
                  file=sys.stderr)
            return 1
        print("README.md sections are up to date")
        return 0
    README.write_text(fresh)
    print("README.md sections regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
