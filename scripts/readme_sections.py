"""Regenerate (or --check) the README sections that come from code and committed results:

  <!-- features:begin --> ... <!-- features:end -->   support matrix from FEATURES (torch-ext/.../features.py)
  <!-- bench-fwd:begin --> ... <!-- bench-fwd:end -->  forward benchmark table from benchmarks/results/fwd_h100.jsonl
  <!-- bench-bwd:begin --> ... <!-- bench-bwd:end -->  backward table from benchmarks/results/bwd_h100.jsonl
  <!-- bench-host:begin --> ... <!-- bench-host:end --> per-call host cost from benchmarks/results/host_h100.jsonl
  <!-- bench-decode:begin --> ... <!-- bench-decode:end --> decode bandwidth from benchmarks/results/decode_h100.jsonl
  <!-- bench-dropout:begin --> ... <!-- bench-dropout:end --> dropout cost from benchmarks/results/dropout_h100.jsonl
  <!-- bench-fwd-targets / bench-bwd-targets --> the target tables (fwd/bwd results, jit_h100.jsonl)
  <!-- bench-decode-summary --> the decode summary from decode_h100.jsonl
  <!-- bench-block-sparse / bench-mods --> from block_sparse_h100.jsonl / mods_h100.jsonl
  <!-- differs --> how this bundle differs from its peers, each row from a results file or a test
  <!-- bench-first-call / prebuilt-size --> first-call latency (first_call_h100.jsonl) and the prebuilt set's size
                 (prebuilt_size.jsonl): scripts/readme_prebuilt.py
  <!-- plots --> PNG plots drawn from the results files (benchmarks/results/plots/), with the sha256 of the data each
                 is drawn from recorded in plots.json: --check compares those hashes, never pixels

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import readme_prebuilt  # noqa: E402  (the prebuilt set's sections: first-call latency, set size)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FWD_RESULTS = ROOT / "benchmarks" / "results" / "fwd_h100.jsonl"
BWD_RESULTS = ROOT / "benchmarks" / "results" / "bwd_h100.jsonl"
HOST_RESULTS = ROOT / "benchmarks" / "results" / "host_h100.jsonl"
DECODE_RESULTS = ROOT / "benchmarks" / "results" / "decode_h100.jsonl"
DROPOUT_RESULTS = ROOT / "benchmarks" / "results" / "dropout_h100.jsonl"
DROPOUT_RUNS = 3  # the README reports the last three bench_dropout runs
JIT_RESULTS = ROOT / "benchmarks" / "results" / "jit_h100.jsonl"
SPARSE_RESULTS = ROOT / "benchmarks" / "results" / "block_sparse_h100.jsonl"
MODS_RESULTS = ROOT / "benchmarks" / "results" / "mods_h100.jsonl"
PLOTS_DIR = ROOT / "benchmarks" / "results" / "plots"
PLOTS_INDEX = PLOTS_DIR / "plots.json"
# forward peers of bench_fwd.py: (results key, label); the backward has the first two
PEERS = (("sdpa_flash", "SDPA FLASH (FA2)"), ("fa4_sm120", "flash-attn-4 SM120 path"), ("cudnn_sm80", "cuDNN-fe SM80"))
# the backward's peers: FROST is cuDNN-frontend's SM120 backward (benchmarks/bench_bwd.py)
BWD_PEERS = (*PEERS[:2], ("frost_sm120", "FROST SM120 (cuDNN-fe)"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _geo(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _cell_name(r: dict) -> str:
    return f"{r['shape']} d{r['d']}, S={r['seqlen']}{', causal' if r['causal'] else ''}"


def _ratio(r: dict, peer: str | None):
    """ours / the peer's TFLOPS in one cell (peer None: the best peer of the cell); None where either is missing
    (a failed correctness check leaves no TFLOPS: never a ratio)."""
    ours = r.get("ours_tflops")
    if peer is None:
        vals = [r[f"{p}_tflops"] for p, _ in (*PEERS, BWD_PEERS[-1]) if r.get(f"{p}_tflops")]
        best = max(vals) if vals else None
    else:
        best = r.get(f"{peer}_tflops")
    return ours / best if ours and best else None


def headline_by_head_dim(cells: list[dict], peers) -> str:
    """Geomean (lowest cell) of ours / each peer over the cells, d <= 128 and d = 256 apart: a peer that is slow at
    one head dim must not carry the headline of the others."""
    groups = (("d ≤ 128", [r for r in cells if r["d"] <= 128]), ("d = 256", [r for r in cells if r["d"] == 256]))
    out = ["| ours ÷ | " + " | ".join(f"{name} ({len(rs)} cells)" for name, rs in groups) + " | all |",
           "|---|" + "---|" * (len(groups) + 1)]
    for key, label in ((None, "best peer per cell"), *peers):
        parts = []
        for _, rs in (*groups, ("all", cells)):
            ratios = [x for x in (_ratio(r, key) for r in rs) if x]
            parts.append(f"{_fmt(_geo(ratios), 2)}× (lowest {_fmt(min(ratios), 2)})" if ratios else "—")
        out.append(f"| {label} | " + " | ".join(parts) + " |")
    return "\n".join(out)


def _failed(cells: list[dict]) -> str:
    bad = [r for r in cells if not r.get("ours_tflops")]
    if not bad:
        return ""
    return (f" **{len(bad)} cell(s) failed our correctness check and are not timed:** "
            + "; ".join(f"{_cell_name(r)}: {r.get('ours_error', 'no result')}" for r in bad) + ".")


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
    timed = [r for r in grid if r.get("ours_tflops")]
    best = max(timed, key=lambda r: r["ours_tflops"]) if timed else None
    out += [
        "",
        f"Over the {len(grid)}-cell grid, d ≤ 128 and d = 256 apart (flash-attn-4's forced SM120 path is slow at "
        "d = 256, which alone would carry a single geomean):",
        "",
        headline_by_head_dim(timed, PEERS),
        "",
        (f"Best cell {_fmt(best['ours_tflops'])} TFLOPS ({_cell_name(best)})." if best else "")
        + (f" The added cells (70B-class GQA, d=96, d=256 GQA, chunked prefill): "
           f"{_fmt(summ.get('extra_geomean_vs_best_peer'), 2)}× the best peer (lowest "
           f"{_fmt(summ.get('extra_min_vs_best_peer'), 2)}); SDPA's causal aligns top-left, so it has no chunked "
           "cell." if summ.get("extra_geomean_vs_best_peer") else "") + _failed(cells),
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
        "| shape (Hq/Hkv/D) | S | causal | ours | ours, deterministic | SDPA FLASH (FA2) | flash-attn-4 SM120 path "
        "| FROST SM120 | ours ÷ FA2 | ours ÷ FROST |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cells:
        s, causal = _seqlen_causal(r)
        out.append(
            f"| {r['shape']} {r['hq']}/{r['hkv']}/{r['d']} | {s} | {causal} "
            f"| {_fmt(r.get('ours_tflops'))} | {_fmt(r.get('ours_deterministic_tflops'))} "
            f"| {_fmt(r.get('sdpa_flash_tflops'))} | {_fmt(r.get('fa4_sm120_tflops'))} "
            f"| {_fmt(r.get('frost_sm120_tflops'))} | {_fmt(_ratio(r, 'sdpa_flash'), 2)} "
            f"| {_fmt(_ratio(r, 'frost_sm120'), 2)} |"
        )
    grid = [r for r in cells if not r.get("extra")]
    timed = [r for r in grid if r.get("ours_tflops")]
    best = max(timed, key=lambda r: r["ours_tflops"]) if timed else None
    extra = [x for x in (_ratio(r, "sdpa_flash") for r in cells if r.get("extra")) if x]
    out += [
        "",
        f"Over the {len(grid)}-cell grid, d ≤ 128 and d = 256 apart (flash-attn-4's SM120 backward is the slow one at "
        "d = 256):",
        "",
        headline_by_head_dim(timed, BWD_PEERS),
        "",
        (f"Best cell {_fmt(best['ours_tflops'])} TFLOPS ({_cell_name(best)})." if best else "")
        + (f" The added cells (70B-class GQA, d=96, d=256 GQA): {_fmt(_geo(extra), 2)}× SDPA FLASH." if extra else "")
        + "".join(f" Chunked prefill ({r['seqlen']} queries over {r['seqlen_k']} keys, bottom-right; no like-for-like "
                  f"SDPA call): {_fmt(_ratio(r, 'fa4_sm120'), 2)}× flash-attn-4 (SM120 path)."
                  for r in cells if r.get("seqlen_k") and r.get("ours_tflops"))
        + (" Gradients checked against an fp32 reference before timing (dQ, dK, dV; `benchmarks/refcheck.py`)."
           if any("ours_max_err" in r for r in cells) else "") + _failed(cells),
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
        if r.get("ours_auto_gbps") is None:  # a failed correctness check: reported, never timed
            name = r["case"] + (f" (q_len {r['q_len']})" if r.get("q_len", 1) != 1 else "")
            out.append(f"| {name} | {r['batch']} | {r['kv_len']} | {r['hkv']} | {r['d']} | {r.get('page_size') or '-'} "
                       f"| error: {r.get('ours_auto_error', 'no result')} |" + " |" * 7)
            continue
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


def bench_fp8_fwd_section() -> str:
    """benchmarks/bench_fp8_fwd.py: the FP8 prefill forward beside our bf16 forward, with the GPU's register-only
    e4m3 / bf16 mma.sync ceiling ratio of the same run and issue 34's target read against it."""
    path = ROOT / "benchmarks" / "results" / "fp8_fwd_h100.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ceil = {r["mma"]: r for r in rows if r.get("kind") == "ceiling"}
    ratio = next(r for r in rows if r.get("kind") == "ceiling_ratio")
    cells = [r for r in rows if "d" in r and not r.get("kind")]
    dev = cells[0].get("device", "?") if cells else "?"
    out = [f"`python benchmarks/bench_fp8_fwd.py` on {dev} (`{path.relative_to(ROOT)}`): `flash_attn_func` on e4m3 "
           "q/k/v (per (batch, KV head) descales, `fp8_quant.quantize_qkv`) beside the same call on the bf16 inputs, "
           "Hq/Hkv 32/8, batch 16K / S, CUDA-event medians, each output checked first against an fp32 reference of "
           "the unquantized inputs (FP8: the FP8 tests' bar against the step-by-step emulation). Register-only "
           f"mma.sync ceiling in the same run: e4m3 {ceil['e4m3']['tflops']:.0f} TFLOPS, bf16 "
           f"{ceil['bf16']['tflops']:.0f} TFLOPS, ratio {ratio['fp8_over_bf16']:.2f} (the proxy has no FP8 mma.sync "
           "unit: ptxas lowers each e4m3 mma to unpacks and two f16 HMMAs), so issue 34's prefill target is "
           f"{ratio['target_speedup']:.2f}x our bf16 forward (0.9 x the ratio; 1.6x where the ratio reaches 1.8).",
           "",
           "| d | S | causal | bf16 TFLOPS | e4m3 TFLOPS | e4m3 ÷ bf16 speed | target met | e4m3 RMS error |",
           "|---|---|---|---|---|---|---|---|"]
    for r in cells:
        if "fp8_ms" in r:
            out.append(f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {r['bf16_tflops']:.0f} | "
                       f"{r['fp8_tflops']:.0f} | {r['fp8_speedup_vs_bf16']:.2f}x | "
                       f"{'yes' if r.get('meets_target') else 'no'} | {r['fp8_rms_err']:.1e} |")
        else:
            why = r.get("fp8_error", "?").split(":")[0]
            bf = f"{r['bf16_tflops']:.0f}" if "bf16_tflops" in r else "-"
            out.append(f"| {r['d']} | {r['s']} | {'yes' if r['causal'] else 'no'} | {bf} | - ({why}: not served) | "
                       "- | no | - |")
    return "\n".join(out) + "\n"


def bench_fp8_decode_section() -> str:
    """benchmarks/bench_fp8_decode.py: the e4m3 KV cache with a bf16 query against the bf16 cache and SDPA.  Rows
    with ``fp8_unsplit_ms`` come from the bench since packed GQA and split-KV (the FP8 default call packs and
    splits; ``fp8_unsplit`` is num_splits=1); older rows measured the kernel without either."""
    # the run of the shipped decode tile (key-split, session 39, H200); fp8_decode_h100.jsonl is the one-warp tile's
    path = ROOT / "benchmarks" / "results" / "fp8_decode_h200.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cells = [r for r in rows if "kv_len" in r]
    dev = cells[0].get("device", "?") if cells else "?"
    new = any("fp8_unsplit_ms" in r for r in cells)
    how = ("the default call: GQA packed into rows, automatic split-KV as the bf16 cache; `unsplit` is "
           "num_splits=1" if new else "one split")
    # rows from the bench since the kernel quantizes a bf16 query itself (config_fp8 q_dtype) say so
    q_how = ("its bf16 query read by the kernel and quantized there per (query row, head)"
             if any(r.get("fp8_query") == "kernel_rows" for r in cells)
             else "its query quantized on the device per KV head")
    out = [f"`python benchmarks/bench_fp8_decode.py` on {dev} (`{path.relative_to(ROOT)}`): one decode step "
           "(q_len 1, Hq/Hkv 32/8, d128), medians of CUDA-graph replays, each path checked against an fp32 "
           "reference first; the bf16 cache runs the default (automatic split-KV), the e4m3 cache the FP8 kernel "
           f"({how}; {q_how}; `pre-quantized q` passes an e4m3 q).",
           ""]
    if new:
        out += ["| B | KV len | bf16 cache µs | e4m3 cache, bf16 q µs | e4m3 ÷ bf16 speed | e4m3 % of copy (FP8 "
                "bytes) | unsplit µs | pre-quantized q µs | SDPA µs | e4m3 RMS error |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda r, k: f"{1000 * r[k]:.1f}" if k in r else "-"  # noqa: E731
        for r in cells:
            out.append(f"| {r['batch']} | {r['kv_len']} | {fmt(r, 'bf16_ms')} | {fmt(r, 'fp8_ms')} | "
                       f"{r.get('fp8_speedup_vs_bf16', float('nan')):.2f}x | "
                       f"{100 * r.get('fp8_pct_of_copy', float('nan')):.0f}% | {fmt(r, 'fp8_unsplit_ms')} | "
                       f"{fmt(r, 'fp8_e4m3q_ms')} | {fmt(r, 'sdpa_ms')} | {r.get('fp8_rms_err', float('nan')):.1e} |")
        paged = [r for r in cells if "fp8_p16_ms" in r or "bf16_p16_ms" in r or "fp8_p16_error" in r]
        if paged:  # issue 34's cells again over shuffled pages of 16 rows (page_table)
            out += ["", "Paged, page size 16 (the same caches over shuffled pages, default calls):", "",
                    "| B | KV len | bf16 paged µs | e4m3 paged, bf16 q µs | e4m3 ÷ bf16 speed (paged) | e4m3 paged % "
                    "of copy (FP8 bytes) | e4m3 paged = contiguous, bitwise |",
                    "|---|---|---|---|---|---|---|"]
            for r in paged:
                same = {True: "yes", False: "NO"}.get(r.get("fp8_p16_bitwise"), "-")
                out.append(f"| {r['batch']} | {r['kv_len']} | {fmt(r, 'bf16_p16_ms')} | {fmt(r, 'fp8_p16_ms')} | "
                           f"{r.get('fp8_p16_speedup_vs_bf16_p16', float('nan')):.2f}x | "
                           f"{100 * r.get('fp8_p16_pct_of_copy', float('nan')):.0f}% | {same} |")
        out += ["", "Issue 34 asks >= 1.8x the bf16 cache at B=8 KV 8K and B=64 KV 2K (paged with page size 16 and "
                "contiguous), and >= 80% of copy bandwidth counting FP8 bytes." if paged else
                "Issue 34 asks >= 1.8x the bf16 cache at B=8 KV 8K and B=64 KV 2K, and >= 80% of copy bandwidth "
                "counting FP8 bytes."]
        return "\n".join(out) + "\n"
    out += ["| B | KV len | bf16 cache µs | e4m3 cache, bf16 q µs | e4m3 ÷ bf16 speed | pre-quantized q µs | SDPA µs "
            "| e4m3 RMS error | bf16 max error |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in cells:
        out.append(f"| {r['batch']} | {r['kv_len']} | {1000 * r['bf16_ms']:.1f} | {1000 * r['fp8_ms']:.1f} | "
                   f"{r['fp8_speedup_vs_bf16']:.2f}x | {1000 * r['fp8_e4m3q_ms']:.1f} | {1000 * r['sdpa_ms']:.1f} | "
                   f"{r['fp8_rms_err']:.1e} | {r['bf16_max_err']:.1e} |")
    if cells:
        lo = min(r["fp8_speedup_vs_bf16"] for r in cells)
        hi = max(r["fp8_speedup_vs_bf16"] for r in cells)
        out += ["", f"The e4m3 cache halves the bytes read but ran at {lo:.2f}-{hi:.2f}x the bf16 cache's speed "
                "in this run, before the FP8 kernel had split-KV and GQA packing: a decode step ran one CTA per "
                "(batch, query head) over the whole cache, with one of its 64+ query rows used. Rerun the bench for "
                "the packed, split kernel."]
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


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def bench_fwd_targets_section() -> str:
    """The forward targets (issue thresholds) against the forward results and the compile-time results."""
    rows = _rows(FWD_RESULTS)
    grid = [r for r in rows if r.get("kind") != "summary" and not r.get("extra") and r.get("ours_tflops")]
    ratios = [(_ratio(r, None), r) for r in grid]
    geo, (low, low_r) = _geo([x for x, _ in ratios]), min(ratios, key=lambda t: t[0])
    geo_fa2 = _geo([_ratio(r, "sdpa_flash") for r in grid])
    best = max(grid, key=lambda r: r["ours_tflops"])
    jit = next((r for r in _rows(JIT_RESULTS) if r.get("kind") == "jit"), {})
    cold, warm = jit.get("cold_first_call_s"), jit.get("warm_cache_first_call_s")
    out = ["| target | measured | met |", "|---|---|---|",
           f"| per cell ÷ best peer: geomean ≥ 1.10, no cell < 0.95 | geomean {geo:.2f}, lowest {low:.2f} "
           f"({_cell_name(low_r)}) | {_yes(geo >= 1.10 and low >= 0.95)} |",
           f"| geomean ≥ 1.20× SDPA FLASH | {geo_fa2:.2f}× | {_yes(geo_fa2 >= 1.20)} |",
           f"| best cell ≥ 450 TFLOPS | {best['ours_tflops']:.0f} TFLOPS ({_cell_name(best)}) "
           f"| {_yes(best['ours_tflops'] >= 450)} |"]
    if cold is not None:
        out.append(f"| first call of a new configuration < 10 s | {cold:.1f} s (compile, new process) "
                   f"| {_yes(cold < 10)} |")
    if warm is not None:
        out.append(f"| later process, warm disk cache < 1 s | {warm:.2f} s (the cached `.so` loads through tvm-ffi "
                   f"without importing CuTe-DSL) | {_yes(warm < 1)} |")
    return "\n".join(out) + "\n"


def bench_bwd_targets_section() -> str:
    """Issue 30's backward targets against the backward results, over every timed cell (the grid and the added
    cells).  Rows whose measurement the results file lacks are left out."""
    rows = _rows(BWD_RESULTS)
    cells = [r for r in rows if r.get("kind") != "summary" and r.get("ours_tflops")]
    out = [f"Over the {len(cells)} timed cells of `benchmarks/results/bwd_h100.jsonl`:", "",
           "| target | measured | met |", "|---|---|---|"]

    def target(label, ratios, geo_min, low_min):
        ratios = [(x, r) for x, r in ratios if x]
        if not ratios:
            return
        geo, (low, low_r) = _geo([x for x, _ in ratios]), min(ratios, key=lambda t: t[0])
        met = geo >= geo_min and (low_min is None or low >= low_min)
        out.append(f"| {label} | {geo:.2f}× geomean, weakest {low:.2f} ({_cell_name(low_r)}) | {_yes(met)} |")

    target("÷ FROST SM120 ≥ 1.15× geomean, no cell < 1.0×", [(_ratio(r, "frost_sm120"), r) for r in cells], 1.15, 1.0)
    target("÷ flash-attn-4 SM120 path at d ≤ 128 ≥ 1.15× geomean, no cell < 1.0×",
           [(_ratio(r, "fa4_sm120"), r) for r in cells if r["d"] <= 128], 1.15, 1.0)
    target("÷ SDPA FLASH ≥ 1.0× geomean", [(_ratio(r, "sdpa_flash"), r) for r in cells], 1.0, None)
    best = max(cells, key=lambda r: r["ours_tflops"]) if cells else None
    if best:
        out.append(f"| best cell ≥ 300 TFLOPS | {best['ours_tflops']:.0f} TFLOPS ({_cell_name(best)}) "
                   f"| {_yes(best['ours_tflops'] >= 300)} |")
    target("deterministic ÷ default ≥ 0.85× (geomean; weakest cell shown)",
           [(r.get("ours_deterministic_tflops") and r["ours_deterministic_tflops"] / r["ours_tflops"], r)
            for r in cells], 0.85, None)
    return "\n".join(out) + "\n"


def _pct_range(xs) -> str:
    xs = [100 * x for x in xs if x is not None]
    lo, hi = round(min(xs)), round(max(xs))
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def bench_decode_summary_section() -> str:
    """The decode results in words: contiguous, paged against contiguous, and MQA against issue 8's 70%."""
    cases = [r for r in _rows(DECODE_RESULTS) if "case" in r]
    contig = [r for r in cases if r["case"] in ("d128", "d256") and r.get("ours_auto_ms")]
    us = [1000 * r["ours_auto_ms"] for r in contig]
    by_key = {(r["case"], r["batch"]): r for r in cases}
    paged = []
    for r in cases:
        base = by_key.get(("d128", r["batch"]))
        if r["case"] in ("d128_p16", "d128_p64") and base and r.get("ours_auto_layers_gbps") \
                and base.get("ours_auto_layers_gbps"):
            paged.append(r["ours_auto_layers_gbps"] / base["ours_auto_layers_gbps"])
    mqa = [by_key.get(("mqa", b)) for b in (1, 8)]
    out = (f"Contiguous decode at d128 and d256 reaches {_pct_range(r['ours_auto_pct_of_copy'] for r in contig)} of "
           f"copy bandwidth in a single-call graph ({min(us):.0f}-{max(us):.0f} us calls; "
           f"{_pct_range(r.get('ours_auto_layers_pct_of_copy') for r in contig)} per call "
           "in an 8-call graph, which is what an engine capturing its whole decode step pays); paged decode (page "
           f"sizes 16 and 64) runs at {_pct_range(paged)} of the contiguous call's bandwidth per call in the 8-call "
           "graph.")
    pre, pre_c = by_key.get(("prefill", 1)), by_key.get(("prefill_contiguous", 1))
    if pre and pre_c and pre.get("ours_auto_gbps") and pre_c.get("ours_auto_gbps"):
        out += (f" The paged chunked prefill (q_len {pre['q_len']} over {pre['kv_len'] // 1024}K, page size "
                f"{pre['page_size']}) runs the TMA kernel (one box per K/V tile, the page read by the producer warp) "
                f"at {100 * pre['ours_auto_gbps'] / pre_c['ours_auto_gbps']:.0f}% of the contiguous call's "
                "bandwidth.")
    if all(r and r.get("ours_auto_layers_pct_of_copy") for r in mqa):
        out += (f" MQA at B=1 and B=8 reads {100 * mqa[0]['ours_auto_layers_pct_of_copy']:.0f}% and "
                f"{100 * mqa[1]['ours_auto_layers_pct_of_copy']:.0f}% of copy per call in the 8-call graph (issue 8 "
                "asks 70%).")
    return out + "\n"


def bench_block_sparse_section() -> str:
    rows = _rows(SPARSE_RESULTS)
    dense = next(r for r in rows if r.get("kind") == "dense")
    sp = next(r for r in rows if r.get("kind") == "sparse")
    return (f"`python benchmarks/bench_block_sparse.py` (results in `benchmarks/results/block_sparse_h100.jsonl`), "
            f"{sp['device']} (the SM120 proxy), B={sp['batch']}, S={sp['seqlen']}, {sp['hq']} heads, d{sp['d']}, "
            f"bf16, ({sp['block'][0]}, {sp['block'][1]}) blocks, a random {100 * sp['density']:.0f}%-density block "
            f"mask ({100 * sp['listed_fraction']:.1f}% of the blocks listed): forward {sp['fwd_ms']:.2f} ms vs "
            f"{dense['fwd_ms']:.2f} ms dense ({sp['fwd_speedup']:.1f}x; issue 9 asks 7x), backward "
            f"{sp['bwd_ms']:.2f} ms vs {dense['bwd_ms']:.1f} ms dense ({sp['bwd_speedup']:.1f}x; "
            f"{sp['bwd_given_speedup']:.1f}x with `block_sparse_tensors_bwd` given: the KV-major lists built from "
            "the forward's are kept for the next backward with the same tensors, so only the first backward pays "
            f"the on-device transpose, {sp['transpose_ms']:.1f} ms on its own in this run).\n")


def bench_mods_section() -> str:
    rows = {(r["case"], r["seqlen"]): r for r in _rows(MODS_RESULTS)}
    c4, c16, doc = rows[("causal", 4096)], rows[("causal", 16384)], rows[("document", 16384)]
    target = c4["target_ratio"]
    met = all(r["fwd_ratio"] <= target and r["bwd_ratio"] <= target for r in (c4, c16, doc))
    return (f"`python benchmarks/bench_mods.py` (results in `benchmarks/results/mods_h100.jsonl`), {c4['device']} "
            f"(the SM120 proxy), d{c4['d']}, {c4['heads']} heads, {c4['tokens'] // 1024}K tokens: causal written as "
            f"a block mask plus `mods.causal()` runs the forward in {c4['fwd_ratio']:.2f}x (S=4K) / "
            f"{c16['fwd_ratio']:.2f}x (S=16K) the time of `causal=True` and the backward in {c4['bwd_ratio']:.2f}x / "
            f"{c16['bwd_ratio']:.2f}x; {len(doc['documents'])} packed documents as a block mask plus "
            f"`mods.document()` take {doc['fwd_ratio']:.2f}x (forward) and {doc['bwd_ratio']:.2f}x (backward) the "
            f"time of the varlen call. Issue 9 asks {target:.2f}x: "
            + ("met in every cell." if met else "**not met in every cell**.") + "\n")


def _split_geo(path: Path, peer: str) -> str:
    """"d ≤ 128 X×, d = 256 Y×" of ours / ``peer`` over a results file's grid cells."""
    grid = [r for r in _rows(path) if r.get("kind") != "summary" and not r.get("extra")]
    parts = []
    for label, sel in (("d ≤ 128", lambda r: r["d"] <= 128), ("d = 256", lambda r: r["d"] == 256)):
        g = _geo([_ratio(r, peer) for r in grid if sel(r)])
        parts.append(f"{label} {_fmt(g, 2)}×")
    return ", ".join(parts)


def differs_section() -> str:
    """How this bundle differs from its peers: each row's numbers from a results file, each claim from a test or a
    results file named in the row."""
    dec = {(r["case"], r["batch"]): r for r in _rows(DECODE_RESULTS) if "case" in r}
    d1 = dec.get(("d128", 1), {})
    fa4_decode = (f"; decode, B=1, 32K keys, d128 (CUDA graph): {_fmt(d1.get('speedup_vs_fa4_sm120'), 1)}× (ours splits "
                  "the keys, the forced SM120 path ran one split)" if d1.get("speedup_vs_fa4_sm120") else "")
    rows = [
        ("upstream flash-attn-4 4.0.0b36, its SM120 path (forced on the proxy)",
         f"ours ÷ it, forward: {_split_geo(FWD_RESULTS, 'fa4_sm120')}; backward: "
         f"{_split_geo(BWD_RESULTS, 'fa4_sm120')}{fa4_decode}. Paged K/V: ours serves it on both kernels, the "
         "benchmark found no paged call on that path",
         "`benchmarks/results/fwd_h100.jsonl`, `bwd_h100.jsonl`, `decode_h100.jsonl`; `tests/test_paged_gpu.py`"),
        ("FlashAttention-2 (PyTorch SDPA, FLASH backend)",
         f"ours ÷ it, forward: {_split_geo(FWD_RESULTS, 'sdpa_flash')}; backward: "
         f"{_split_geo(BWD_RESULTS, 'sdpa_flash')}. Ours keeps SM120's 99 KB per block on every tile (the compile "
         "gate checks each one); FA2's H100 tiles are not held to it, so the proxy's ratio is not an SM120 "
         "measurement",
         "`benchmarks/results/fwd_h100.jsonl`, `bwd_h100.jsonl`; `scripts/compile_gate.py`"),
        ("cuDNN-frontend 1.32 (home of FROST): its CuTe-DSL SM80 forward kernel, `sdpa_fwd_wrapper_sm80`",
         f"ours ÷ it, forward: {_split_geo(FWD_RESULTS, 'cudnn_sm80')}; its backward was not benchmarked here",
         "`benchmarks/results/fwd_h100.jsonl`"),
        ("the other `flash-attn-4-sm120` bundle on the Hub (built from upstream pull requests)",
         "not measured here: no results file compares it yet (adding it as a peer of `bench_fwd.py` and "
         "`bench_bwd.py` would fill this row)", "—"),
    ]
    out = ["| against | how this bundle differs (measured on the proxy) | behind it |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out) + "\n"


# ---- plots --------------------------------------------------------------------------------------------------------
PLOT_STYLE = 1  # bump when the drawing code changes: it enters every plot's data hash, so --check asks for a redraw


def _short(r: dict) -> str:
    s = r["seqlen"]
    tag = f"{s // 1024}K" if s >= 1024 else str(s)
    if r.get("seqlen_k"):
        tag += f"/{r['seqlen_k'] // 1024}K"
    return f"{r['shape']} {tag}{' c' if r['causal'] else ''}"


def _tflops_data(path: Path, peers) -> dict:
    cells = [r for r in _rows(path) if r.get("kind") != "summary"]
    return {"style": PLOT_STYLE, "series": ["ours", *[label for _, label in peers]],
            "cells": [[_short(r), r.get("ours_tflops"), *[r.get(f"{key}_tflops") for key, _ in peers]] for r in cells]}


def _decode_data() -> dict:
    cases = [r for r in _rows(DECODE_RESULTS) if "case" in r and r.get("q_len", 1) == 1]
    return {"style": PLOT_STYLE, "copy_gbps": next((r["copy_gbps"] for r in cases), None),
            "points": [[r["case"], r["batch"], r["kv_len"], r.get("ours_auto_pct_of_copy"),
                        r.get("ours_auto_layers_pct_of_copy"),
                        (r["fa4_sm120_gbps"] / r["copy_gbps"]) if r.get("fa4_sm120_gbps") else None] for r in cases]}


PLOTS = {  # name: (data from the results files, title, README alt text)
    "fwd_tflops": (lambda: _tflops_data(FWD_RESULTS, PEERS), "forward TFLOPS per cell, bf16",
                   "forward TFLOPS per cell, ours and each peer"),
    "bwd_tflops": (lambda: _tflops_data(BWD_RESULTS, BWD_PEERS), "backward TFLOPS per cell, bf16",
                   "backward TFLOPS per cell, ours and each peer"),
    "decode_bandwidth": (_decode_data, "decode: K+V bandwidth / copy bandwidth vs KV length",
                         "decode bandwidth as a fraction of copy bandwidth against the KV length"),
}


def _data_hash(data: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _draw(name: str, data: dict, title: str, path: Path) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(f"plot {name} must be redrawn and matplotlib is missing: pip install -r requirements-dev.txt "
                         f"({exc})") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if name == "decode_bandwidth":
        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=72)
        for case in dict.fromkeys(p[0] for p in data["points"]):
            pts = sorted((p for p in data["points"] if p[0] == case), key=lambda p: p[2])
            one = [(p[2], 100 * p[3]) for p in pts if p[3] is not None]  # a failed check has no point
            eight = [(p[2], 100 * p[4]) for p in pts if p[4] is not None]
            if not one:
                continue
            line, = ax.plot(*zip(*one), marker="o", label=f"{case} (1-call graph)")
            if eight:
                ax.plot(*zip(*eight), marker="x", linestyle="--", color=line.get_color(),
                        label=f"{case} (8-call graph)")
            peer = [(p[2], 100 * p[5]) for p in pts if p[5]]
            if peer:
                ax.plot(*zip(*peer), marker="s", linestyle=":", color=line.get_color(), label=f"{case} fa4 SM120")
        ax.set_xscale("log", base=2)
        ax.set_xticks([p[2] for p in data["points"]], [f"{p[2] // 1024}K\nB={p[1]}" for p in data["points"]])
        ax.set_ylabel("% of copy bandwidth")
        ax.set_ylim(0, 110)
        ax.legend(fontsize=6, ncol=3, loc="lower left")
    else:
        import numpy as np

        cells = data["cells"]
        fig, ax = plt.subplots(figsize=(12, 3.8), dpi=72)
        width = 0.8 / len(data["series"])
        xs = np.arange(len(cells))
        for k, label in enumerate(data["series"]):
            ax.bar(xs + k * width, [c[1 + k] or 0 for c in cells], width, label=label)  # no bar: no timing
        ax.set_xticks(xs + 0.4 - width / 2, [c[0] for c in cells], rotation=70, fontsize=6, ha="right")
        ax.set_ylabel("TFLOPS")
        ax.legend(fontsize=7, ncol=len(data["series"]))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def plots_section(check: bool = False) -> str:
    """Draws the plots whose data changed (or checks, with ``check``, that none did) and lists them."""
    index = json.loads(PLOTS_INDEX.read_text()) if PLOTS_INDEX.exists() else {}
    stale, fresh_index = [], {}
    for name, (data_fn, title, _) in PLOTS.items():
        digest = _data_hash(data_fn())
        png = PLOTS_DIR / f"{name}.png"
        fresh_index[name] = {"png": png.name, "data_sha256": digest}
        if index.get(name, {}).get("data_sha256") != digest or not png.exists():
            stale.append(name)
    if stale and check:
        raise SystemExit(f"plots drawn from older results or drawing code: {', '.join(stale)}: run python "
                         "scripts/readme_sections.py")
    if stale:
        PLOTS_DIR.mkdir(parents=True, exist_ok=True)
        for name in stale:
            data_fn, title, _ = PLOTS[name]
            _draw(name, data_fn(), title, PLOTS_DIR / f"{name}.png")
        PLOTS_INDEX.write_text(json.dumps(fresh_index, indent=1, sort_keys=True) + "\n")
    rel = PLOTS_DIR.relative_to(ROOT)
    return ("Drawn by `scripts/readme_sections.py` from the results files above (`" + str(rel) + "/plots.json` "
            "records the sha256 of the data each plot is drawn from, with `PLOT_STYLE`, bumped when the drawing "
            "code changes; `--check` fails when a plot was not redrawn after either changed).\n\n"
            + "\n".join(f"![{alt}]({rel}/{name}.png)" for name, (_, _, alt) in PLOTS.items()) + "\n")


def _devices_of(arch: str) -> str:
    """The capabilities whose devices load ``arch``'s cubins (device.CAPABILITIES), e.g. "8.0, 8.6, 8.9"."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from scripts.compile_gate import _package

    if "flash_attn_4_sm120" not in sys.modules:
        _package()
    from flash_attn_4_sm120 import device

    return ", ".join(f"{ma}.{mi}" for (ma, mi), f in device.CAPABILITIES.items() if f.arch == arch)


def gate_section() -> str:
    """The compile gate's coverage per shipped target, from the committed full runs
    (benchmarks/results/gate_full_<arch>.jsonl, one per scripts/gate_ci.FULL_ARCHS), the devices that load each
    target's cubins (device.CAPABILITIES) and the CI shard counts of scripts/gate_ci.py (its largest shard counted
    over the full run's configurations)."""
    spec = importlib.util.spec_from_file_location("_gate_ci", ROOT / "scripts" / "gate_ci.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    lines = ["| target | devices (capability) | full run (committed) | passing | built with | spill only with the run's "
             "libs (rebuilt with CI's: pass) | CI builds per commit |", "|---|---|---|---|---|---|---|"]
    for arch in gc.FULL_ARCHS:
        count = gc.CI_SHARDS.get(arch)
        path = gc.full_run_path(arch)
        devices = _devices_of(arch)
        if not path.exists():
            lines.append(f"| `{arch}` | {devices} | not committed yet (`{path.relative_to(ROOT)}`): CI fails until "
                         f"it is | - | - | - | 1 shard of {count} |")
            continue
        meta, rows = gc.read_run(path)
        names = sorted(rows)
        largest = max(sum(gc.in_shard(n, i, count) for n in names) for i in range(count)) if count else 0
        ok = sum(1 for r in rows.values() if gc.row_passes(r))
        other = sorted(n for n, r in rows.items() if r.get("problems") and gc.row_passes(r))
        other_txt = (f"{len(other)} ({', '.join(f'`{n}`' for n in other)})" if other else "0")
        built = (f"nvidia-cutlass-dsl {meta.get('cutlass_dsl')} ({meta.get('libs')}), commit "
                 f"{str(meta.get('commit'))[:10]}") if meta else "no record"
        if meta and meta.get("recheck_libs"):
            built += f"; failing rows rebuilt with {meta['recheck_libs']}"
        for ref in (meta or {}).get("refreshes", []):  # compile_gate --refresh after a kernel-file change
            at = f"; refreshed at commit {str(ref.get('commit'))[:10]}"
            if ref.get("files"):
                built += (f"{at} ({', '.join(ref['files'])} changed: its {ref.get('rebuilt')} configurations of "
                          f"{', '.join(ref.get('kinds', []))} rebuilt with {ref.get('libs')})")
            elif ref.get("rebuilt"):
                built += f"{at} ({ref['rebuilt']} configurations new to the worklist built with {ref.get('libs')})"
            if ref.get("dropped"):
                built += (f"{at + ':' if not ref.get('files') and not ref.get('rebuilt') else ','} {ref['dropped']} "
                          "configurations that left the worklist dropped")
        lines.append(f"| `{arch}` | {devices} | {len(rows):,} configurations (`{path.relative_to(ROOT)}`) | {ok:,} | "
                     f"{built} | {other_txt} | 1 shard of {count} (at most {largest} configurations) |")
    return "\n".join(lines) + "\n"


SECTIONS = {"features": features_section, "gate": gate_section, "bench-fwd": bench_fwd_section, "bench-bwd": bench_bwd_section,
            "bench-host": bench_host_section, "bench-decode": bench_decode_section, "bench-fp8-decode": bench_fp8_decode_section,
            "bench-fp8-fwd": bench_fp8_fwd_section,
            "bench-dropout": bench_dropout_section, "bench-fwd-targets": bench_fwd_targets_section,
            "bench-bwd-targets": bench_bwd_targets_section, "bench-decode-summary": bench_decode_summary_section,
            "bench-block-sparse": bench_block_sparse_section, "bench-mods": bench_mods_section,
            "plots": plots_section, "differs": differs_section,
            "bench-first-call": readme_prebuilt.first_call_section, "prebuilt-size": readme_prebuilt.size_section}


def render(text: str, check: bool = False) -> str:
    for name, fn in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            raise SystemExit(f"README.md lacks the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        body = fn(check=check) if fn is plots_section else fn()
        text = f"{head}{begin}\n{body}{end}{tail}"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    current = README.read_text()
    fresh = render(current, check=args.check)
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
