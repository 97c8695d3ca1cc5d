"""README sections of the prebuilt set (issue 33), rendered by scripts/readme_sections.py:

  <!-- bench-first-call:begin --> ... :end -->  the last run of benchmarks/bench_jit.py
                                               (benchmarks/results/first_call_h100.jsonl)
  <!-- prebuilt-size:begin --> ... :end -->     the newest full build per arch (benchmarks/results/prebuilt_size.jsonl,
                                               written by build_bundle.py / publish.py --prebuilt --report)

A missing file or a file without a full row renders a sentence that says so and names the command that makes it:
the README never shows a number no results file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_CALL_RESULTS = ROOT / "benchmarks" / "results" / "first_call_h100.jsonl"
SIZE_RESULTS = ROOT / "benchmarks" / "results" / "prebuilt_size.jsonl"
FIRST_CALL_TARGET_S = 0.3  # issue 33: the prebuilt first forward, fresh process, empty user cache
SIZE_BUDGET_MB = 40.0  # issue 33: per arch
SOURCES = (("prebuilt", "prebuilt set"), ("warm_disk", "warm disk cache"), ("cold_jit", "cold JIT (compile)"),
           ("sdpa", "torch SDPA (floor)"))
BENCH_CMD = ("python benchmarks/bench_jit.py --build-prebuilt /tmp/fa4-prebuilt --jobs 15 "
             "--out benchmarks/results/first_call_h100.jsonl")
SIZE_CMD = ("python scripts/build_bundle.py --prebuilt --arch sm_120a --jobs 60 --out /tmp/fa4-prebuilt-sm120a "
            "--report benchmarks/results/prebuilt_size.jsonl")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _s(x) -> str:
    if x is None:
        return "—"
    return f"{x:.2f} s" if x >= 0.995 else f"{x * 1000:.0f} ms"


def first_call_section() -> str:
    runs = [r for r in _rows(FIRST_CALL_RESULTS) if r.get("kind") == "first_call"]
    if not runs:
        return (f"No GPU run of `bench_jit.py` is committed yet (`{BENCH_CMD}` on the GPU writes it; the "
                "table comes from its last line).\n")
    run = runs[-1]
    by = {(r["source"], r["call"]): r for r in run["rows"]}
    built = run.get("prebuilt_set")
    head = f"{run['device']}, torch {run['torch']}, {run['shape']}; each cell the median of fresh processes"
    if built:
        head += (f"; prebuilt set built for {built['arch']} through the publish path: {built['configurations']} "
                 f"objects, {built['mb']:.1f} MB")
    out = [head + " (`benchmarks/results/first_call_h100.jsonl`).", "",
           "| source | first forward | first forward + backward | compiled | where the first forward went |",
           "|---|---|---|---|---|"]
    for source, label in SOURCES:
        fwd, both = by.get((source, "fwd")), by.get((source, "fwd_bwd"))
        if fwd is None and both is None:
            continue
        compiled = "—" if source == "sdpa" else " / ".join(
            str(r.get("compiles", "—")) if r else "—" for r in (fwd, both))
        where = "—"
        if fwd is not None and "load_s" in fwd:
            parts = [f"loading {_s(fwd['load_s'])}" + (
                f" (of which tvm-ffi's import and the runtime library {_s(fwd['runtime_s'])})"
                if fwd["runtime_s"] else "")]
            if fwd["compile_s"]:
                parts.append(f"compiling {_s(fwd['compile_s'])}")
            parts.append(f"launch and GPU {_s(fwd['rest_s'])}")
            where = ", ".join(parts)
        out.append(f"| {label} | {_s(fwd and fwd['seconds'])} | {_s(both and both['seconds'])} | {compiled} "
                   f"| {where} |")
    pre = by.get(("prebuilt", "fwd"))
    if pre is not None:
        met = "met" if pre["seconds"] <= FIRST_CALL_TARGET_S else "not met"
        out += ["", f"Target: prebuilt first forward ≤ {FIRST_CALL_TARGET_S} s: {_s(pre['seconds'])}, {met}."]
    autograd = (by.get(("prebuilt", "fwd_bwd")) or {}).get("torch_autograd_first_s")
    if autograd is not None:
        out += ["", f"The forward + backward column excludes torch's own first backward with an explicit grad "
                    f"(it imports sympy: {_s(autograd)} here, whatever the attention), paid before the clock."]
    return "\n".join(out) + "\n"


def size_section() -> str:
    rows = _rows(SIZE_RESULTS)
    full = {}
    for r in rows:
        if r.get("kind") == "prebuilt_size" and r.get("sample") is None:
            full[r["arch"]] = r  # the newest full build of each arch
    samples = [r for r in rows if r.get("kind") == "prebuilt_size" and r.get("sample") is not None]
    out = []
    if full:
        out += ["| arch | objects | size | largest object | ≤ 40 MB | built in | cutlass-dsl |",
                "|---|---|---|---|---|---|---|"]
        for arch, r in sorted(full.items()):
            libs = f" ({r['libs']} libs)" if r.get("libs") else ""
            out.append(f"| {arch} | {r['configurations']} | {r['mb']:.1f} MB | {r['largest_kb']:.0f} KB "
                       f"| {'yes' if r['mb'] <= SIZE_BUDGET_MB else 'no'} | {r['build_s']:.0f} s "
                       f"({r['jobs']} workers, {r['cpus']} CPUs) | {r['cutlass_dsl']}{libs} |")
        out += ["", "(`benchmarks/results/prebuilt_size.jsonl`.)"]
    else:
        out.append(f"No full build of a published set is recorded yet (`{SIZE_CMD}` records one; "
                   "`publish.py --prebuilt` takes the same `--report`).")
    if samples:
        s = samples[-1]
        out += ["", f"Newest sample build: {s['configurations']} configurations for {s['arch']}, {s['mb']:.2f} MB "
                    f"({', '.join(sorted(s['by_kernel']))})."]
    return "\n".join(out) + "\n"
