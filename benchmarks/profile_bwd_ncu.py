"""Nsight Compute metrics of every kept and reverted backward variant (issue 30 item 4), next to its timing, one
JSON line per (variant, cell, kernel) and one total per (variant, cell):

    python benchmarks/profile_bwd_ncu.py [--cells llama3-8b:4096 ...] [--variants default pair ...] [--out F]

(default --out: benchmarks/results/bwd_ncu_<device>.jsonl, appended).  Variants (``VARIANTS``): the library's
default (the fused kernel where a fused tile serves, else the dK/dV + dQ pair), ``deterministic=True`` (the relay
form at d64, the pair elsewhere), the pair forced for the default call (the pre-fused default; hides
``dispatch_bwd.fused_plan``), the reverted fused tiles forced through ``config_bwd._FUSED_TILES`` (64x64 at d64 and
d128, 32x32 with 4 warps at d256, which spills on sm_120a), the relay at d128 (``config_bwd.RELAY_HEAD_DIMS``), the
relay's turn released after the S mma (``DQ_RELAY_RELEASE``) and the plain launch order (``BWD_LPT_ORDER``), and the
peers SDPA FLASH and FROST (cuDNN-frontend's SM120 backward, capability presented as 12.0).  The last two of ours
change compile-time constants that are not part of the compile key, so they run in their own processes with their
own disk cache (``FA4_SM120_CACHE_DIR``) and no prebuilt set.

Per kernel: ncu's duration (at ncu's base clocks: ``--clock-control base``), tensor pipe % (mma.sync's HMMA pipe),
shared-memory pipe % (LSU wavefronts to shared memory), eligible and active warps per scheduler, L2 and DRAM bytes,
registers, the global red/atom instructions and their count per dQ element (B*S*Hq*d: a ``red.global.add.v2.f32``
covers 64 elements per warp instruction, so a query tile that takes adds from n key tiles shows n/64).  Each metric
has a fallback list (``METRICS``); the first one ``ncu --query-metrics`` lists is used, and one ncu rejects is
dropped and the process rerun once.  ``event_ms``: the variant's median CUDA-event time (10 calls), measured in the
same process outside the profiled range.  Before it is profiled each variant's dQ/dK/dV are checked against
bench_bwd.py's fp32 reference (batch 0, KV head 0), and the kernels it built are checked to be the variant's
(``Variant.expect``); a failure is an error row, never profiled.

How: the kernels are compiled first (every (cell, variant) of ours in parallel, without ncu, into the disk cache);
then one process per group of variants runs under ``ncu --csv --profile-from-start off --metrics ... --kernel-name
regex:... --launch-skip/--launch-count``: per job, outside the profiled range, the inputs, a check and warm-up
calls; inside it (torch.cuda.profiler start/stop) a sentinel kernel (torch.cuda._sleep, ``spin_kernel``) and one
backward call, so the CSV's kernels are split into jobs at the sentinels (the default ``--kernel-regex .`` keeps
every kernel of the call, torch's fills of the dQ workspace included).  ``--budget-s`` bounds the whole run: jobs
past it are recorded as skipped (ours first, then the peers, FROST last: it compiles in-process).  ncu's output of
each process is kept in ``--workdir`` (default $OUT/bwd_ncu).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SENTINEL = "spin_kernel"  # torch.cuda._sleep's kernel: marks the start of each job's profiled range

# quantity -> fallback list of (metrics summed, scale); the first whose metrics ncu lists is used.  The first
# entries of duration, tensor pipe, shared pipe, bank conflicts and warps were read on the H100 proxy before
# (benchmarks/experiments/results/ncu_bwd_d128_s4k_ours_h100_s27.csv, ncu_dropout_fwd_cycles_h100_s29.csv).
METRICS: dict[str, tuple[tuple[tuple[str, ...], float], ...]] = {
    "duration_ns": ((("gpu__time_duration.sum",), 1.0),),
    "tensor_pipe_pct": ((("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",), 1.0),
                        (("sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",), 1.0),
                        (("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",), 1.0)),
    "shared_pipe_pct": ((("l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",), 1.0),
                        (("smsp__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",), 1.0)),
    "shared_bank_conflicts": ((("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",), 1.0),),
    "eligible_warps": ((("smsp__warps_eligible.avg.per_cycle_active",), 1.0),),
    "active_warps": ((("smsp__warps_active.avg.per_cycle_active",), 1.0),),
    "l2_bytes": ((("lts__t_bytes.sum",), 1.0), (("lts__t_sectors.sum",), 32.0)),
    "dram_bytes": ((("dram__bytes.sum",), 1.0), (("dram__bytes_read.sum", "dram__bytes_write.sum"), 1.0),
                   (("dram__sectors_read.sum", "dram__sectors_write.sum"), 32.0)),
    "red_inst": ((("smsp__inst_executed_op_global_red.sum",), 1.0),
                 (("smsp__sass_inst_executed_op_global_red.sum",), 1.0)),
    "atom_inst": ((("smsp__inst_executed_op_global_atom.sum",), 1.0),
                  (("smsp__sass_inst_executed_op_global_atom.sum",), 1.0)),
    "registers": ((("launch__registers_per_thread",), 1.0),),
}
SUMMED = ("duration_ns", "l2_bytes", "dram_bytes", "red_inst", "atom_inst", "shared_bank_conflicts")
WEIGHTED = ("tensor_pipe_pct", "shared_pipe_pct", "eligible_warps", "active_warps")  # by duration in totals
UNIT_SCALE = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9,
              "second": 1e9, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
              "KB": 1e3, "MB": 1e6, "GB": 1e9}


# ---- variants and cells --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    status: str  # "kept", "reverted" or "peer"
    what: str
    impl: str = "ours"  # "ours", "sdpa_flash" or "frost"
    deterministic: bool = False
    head_dims: tuple[int, ...] = ()  # where it applies (empty: every head dim)
    causal: bool | None = None  # the walks it applies to (None: both)
    fused_tile: tuple[int, int, int] | None = None  # forced as the only fused tile of the head dim, every walk
    relay_here: bool = False  # the head dim joins config_bwd.RELAY_HEAD_DIMS
    hide_fused: bool = False  # dispatch_bwd.fused_plan -> None: the dK/dV + dQ pair
    constants: tuple[tuple[str, object], ...] = ()  # config_bwd compile-time constants outside the compile key
    expect: str | None = None  # regex the built kernels' config names (joined by ",") must match
    cost_s: float = 10.0  # a job starts only this long before the deadline (FROST compiles in the process)

    @property
    def isolated(self) -> bool:
        return bool(self.constants)


_FUSED = r"_{}x{}w{}f(r)?(_|,|$)"
VARIANTS = {v.name: v for v in (
    Variant("default", "kept", "the library's default call (fused where a fused tile serves, else the pair)"),
    Variant("deterministic", "kept", "deterministic=True: the relay form at d64/d128 (one loop, a GQA group's "
            "heads inner), the pair at d96", deterministic=True, head_dims=(64, 96, 128)),
    Variant("pair", "reverted", "the dK/dV + dQ kernel pair for the default call (the pre-fused default)",
            head_dims=(64, 96), hide_fused=True, expect=r"(^|,)dq_"),
    Variant("fused_64x64", "reverted", "fused tile 64x64, 8 warps on every walk (config_bwd._FUSED_TILES)",
            head_dims=(64, 128), fused_tile=(64, 64, 8), expect=_FUSED.format(64, 64, 8)),
    Variant("fused_32x32w4", "reverted", "fused tile 32x32, 4 warps at d256 (spills on sm_120a)",
            head_dims=(256,), fused_tile=(32, 32, 4), expect=_FUSED.format(32, 32, 4)),
    Variant("pair_deterministic_d128", "reverted", "deterministic=True on the dK/dV + dQ pair at d128 (its form "
            "before the one-loop relay)", deterministic=True, head_dims=(128,), hide_fused=True, expect=r"(^|,)dq_"),
    Variant("relay_heads_outer", "reverted", "the relay's walk with each head's query tiles in turn at d128 "
            "(RELAY_HEADS_INNER=False)", deterministic=True, head_dims=(128,),
            constants=(("RELAY_HEADS_INNER", False),), expect=r"w8(r\d+)?fr(_|,|$)"),
    Variant("relay_after_s", "reverted", "the relay's turn released after the S mma (DQ_RELAY_RELEASE)",
            deterministic=True, head_dims=(64,), constants=(("DQ_RELAY_RELEASE", "after_s"),),
            expect=r"fr(_|,|$)"),
    Variant("lpt_off", "reverted", "the backward's plain launch order on causal walks (BWD_LPT_ORDER=False)",
            causal=True, head_dims=(64, 128), constants=(("BWD_LPT_ORDER", False),)),
    Variant("sdpa_flash", "peer", "SDPA FLASH (FlashAttention-2), K/V expanded to the query heads",
            impl="sdpa_flash"),
    Variant("frost", "peer", "FROST: cuDNN-frontend's SM120 backward, capability presented as 12.0", impl="frost",
            cost_s=60.0),
)}
DEFAULT_CELLS = ("llama3-8b:4096", "llama3-8b:4096:causal", "mha-d64:4096:causal", "mha-d256:4096:causal")


@dataclass(frozen=True)
class Cell:
    shape: str
    hq: int
    hkv: int
    d: int
    seqlen: int
    batch: int
    causal: bool

    @property
    def spec(self) -> str:
        return f"{self.shape}:{self.seqlen}" + (":causal" if self.causal else "")

    @property
    def dq_elems(self) -> int:
        return self.batch * self.seqlen * self.hq * self.d


def parse_cell(spec: str) -> Cell:
    """'shape:seqlen[:causal]' over bench_fwd.py's shapes (batch: its TOKENS // seqlen)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fwd import EXTRA_CELLS, SHAPES, TOKENS

    parts = spec.split(":")
    shapes = {**SHAPES, **{n: c[:3] for n, c in EXTRA_CELLS.items()}}
    if (len(parts) not in (2, 3) or parts[0] not in shapes or not parts[1].isdigit()
            or parts[2:] not in ([], ["causal"])):
        raise ValueError(f"cell {spec!r}: expected 'shape:seqlen[:causal]' with a shape of {sorted(shapes)}")
    hq, hkv, d = shapes[parts[0]]
    s = int(parts[1])
    return Cell(parts[0], hq, hkv, d, s, max(1, TOKENS // s), parts[2:] == ["causal"])


def applies(v: Variant, cell: Cell) -> bool:
    return (not v.head_dims or cell.d in v.head_dims) and (v.causal is None or v.causal == cell.causal)


def plan_groups(variants, cells) -> list[tuple[str, list[tuple[str, str]]]]:
    """Processes to run, in order, each (group, [(cell spec, variant)]): ours in one process, each isolated variant
    in its own, then the peers (SDPA FLASH for every cell before FROST, which compiles in-process)."""
    main, isolated, peers = [], {v.name: [] for v in variants if v.isolated}, []
    for c in cells:  # a process builds each cell's inputs and reference once, cell after cell
        for v in variants:
            if not applies(v, c):
                continue
            if v.impl != "ours":
                peers.append((v.impl != "sdpa_flash", (c.spec, v.name)))
            elif v.isolated:
                isolated[v.name].append((c.spec, v.name))
            else:
                main.append((c.spec, v.name))
    groups = [("main", main)] if main else []
    groups += [(name, jobs) for name, jobs in isolated.items() if jobs]
    if peers:
        groups.append(("peers", [job for _, job in sorted(peers, key=lambda p: p[0])]))
    return groups


def group_env(group: str) -> dict[str, str]:
    """Environment of a group's process: an isolated variant gets its own disk cache and no prebuilt set."""
    v = VARIANTS.get(group)
    if v is None or not v.isolated:
        return {}
    base = os.environ.get("FA4_SM120_CACHE_DIR") or str(Path.home() / ".cache" / "flash_attn_4_sm120")
    return {"FA4_SM120_CACHE_DIR": f"{base}-ncu-{v.name}", "FA4_SM120_PREBUILT": "0"}


# ---- metric choice, ncu command, CSV ---------------------------------------------------------------------------
def metric_base(name: str) -> str:
    return name.split(".", 1)[0]


def parse_query_metrics(text: str) -> set[str] | None:
    """Base metric names in ``ncu --query-metrics`` output; None when it does not look like a listing."""
    names = {m.group(1) for m in re.finditer(r"^\s*([a-z0-9]+__[a-z0-9_]+)\b", text, re.M)}
    return names if "gpu__time_duration" in names else None


def choose_metrics(available: set[str] | None, dropped=frozenset()) -> dict[str, tuple[tuple[str, ...], float]]:
    """Per quantity, the first candidate whose metrics are all listed (``available``; None: unknown, the first one
    not dropped) and none dropped; a quantity without one is left out."""
    chosen = {}
    for q, cands in METRICS.items():
        for names, scale in cands:
            if any(n in dropped for n in names):
                continue
            if available is None or all(metric_base(n) in available for n in names):
                chosen[q] = (names, scale)
                break
    return chosen


def rejected_metrics(text: str, requested) -> set[str]:
    """Requested metrics that an ``==ERROR==`` line of ncu's output names (by full or base name)."""
    errors = [ln for ln in text.splitlines() if "==ERROR==" in ln]
    return {m for m in requested for ln in errors if re.search(rf"\b{re.escape(metric_base(m))}\b", ln)}


def ncu_argv(ncu: str, metrics, child: list[str], kernel_regex: str = ".", launch_skip: int = 0,
             launch_count: int = 0, clock_control: str = "base") -> list[str]:
    argv = [ncu, "--csv", "--print-units", "base", "--profile-from-start", "off", "--target-processes",
            "application-only", "--clock-control", clock_control, "--metrics", ",".join(sorted(set(metrics))),
            "--kernel-name", f"regex:{kernel_regex}|{SENTINEL}", "--launch-skip", str(launch_skip)]
    if launch_count:
        argv += ["--launch-count", str(launch_count)]
    return argv + child


def _number(text: str, unit: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None  # "n/a", empty
    return value * UNIT_SCALE.get(unit.strip(), 1.0)


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of ncu's ``--csv`` metrics output (one row per kernel and metric; ncu's own ``==PROF==`` lines and
    anything else not quoted are skipped), in launch order: {id, name, grid, block, metrics: {name: value}} with
    times in ns and sizes in bytes."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    kernels: dict[tuple, dict] = {}
    for row in csv.DictReader(lines):
        if not row.get("Metric Name") or not (row.get("ID") or "").isdigit():
            continue  # rule rows of a section, repeated headers
        key = (row.get("Process ID", ""), int(row["ID"]))
        k = kernels.setdefault(key, dict(id=key[1], name=row["Kernel Name"], grid=row.get("Grid Size"),
                                         block=row.get("Block Size"), metrics={}))
        k["metrics"][row["Metric Name"]] = _number(row["Metric Value"], row.get("Metric Unit") or "")
    pids = list(dict.fromkeys(p for p, _ in kernels))
    return [kernels[k] for k in sorted(kernels, key=lambda k: (pids.index(k[0]), k[1]))]


def split_at_sentinels(kernels: list[dict], jobs: list) -> list[tuple[object, list[dict]]]:
    """The kernels after each sentinel kernel, paired with ``jobs`` (the profiled jobs, in order)."""
    groups: list[list[dict]] = []
    for k in kernels:
        if SENTINEL in k["name"]:
            groups.append([])
        elif not groups:
            raise ValueError(f"kernel {k['name'][:80]} profiled before the first sentinel")
        else:
            groups[-1].append(k)
    if len(groups) != len(jobs):
        raise ValueError(f"{len(groups)} sentinel kernels in ncu's output for {len(jobs)} profiled jobs")
    return list(zip(jobs, groups))


def short_name(name: str) -> str:
    """CuTe-DSL kernels: module and class ('bwd_dkdvFlashBwdDkdv'); others: the name before template/arguments."""
    m = re.search(r"kernels(\w+?)_object", name) or re.search(r"kernel_cutlass_kernel_(\w+?)_object", name)
    if m:
        return m.group(1)
    head = re.split(r"[<(]", name, maxsplit=1)[0].split()
    return head[-1].split("::")[-1] if head else name


def quantity(metrics: dict, chosen) -> float | None:
    names, scale = chosen
    vals = [metrics.get(n) for n in names]
    return None if any(x is None for x in vals) else scale * sum(vals)


def kernel_rows(base: dict, kernels: list[dict], chosen: dict, dq_elems: int) -> list[dict]:
    """One row per kernel and a ``total`` row (sums; pipe % and warps weighted by duration); reds_per_dq_elem:
    global red + atom instructions per dQ element."""
    rows = []
    for i, k in enumerate(kernels):
        vals = {q: quantity(k["metrics"], c) for q, c in chosen.items()}
        reds = [vals.get(q) for q in ("red_inst", "atom_inst") if q in vals]
        rows.append(dict(base, kind="kernel", index=i, kernel=short_name(k["name"]), kernel_full=k["name"][:200],
                         grid=k["grid"], block=k["block"], **vals,
                         reds_per_dq_elem=(sum(reds) / dq_elems if reds and None not in reds else None)))
    total = dict(base, kind="total", kernels=len(rows))
    for q in SUMMED:
        xs = [r.get(q) for r in rows]
        total[q] = sum(xs) if rows and q in chosen and None not in xs else None
    for q in WEIGHTED:
        pairs = [(r.get(q), r.get("duration_ns")) for r in rows]
        ok = rows and q in chosen and all(x is not None and w for x, w in pairs)
        total[q] = sum(x * w for x, w in pairs) / sum(w for _, w in pairs) if ok else None
    reds = [total[q] for q in ("red_inst", "atom_inst") if q in chosen]
    total["reds_per_dq_elem"] = sum(reds) / dq_elems if reds and None not in reds else None
    return rows + [total]


def group_rows(meta: dict, kernels: list[dict], chosen: dict, base: dict) -> list[dict]:
    """The rows of one profiled process: its child's ``meta`` (the jobs, in order, with what each recorded) and
    the kernels ncu profiled, split at the sentinels; a job that was not profiled (failed check, wrong kernels,
    error, past the budget) is an ``error`` row."""
    entries, rows = meta.get("jobs", []), []
    try:
        split = split_at_sentinels(kernels, [e for e in entries if e.get("profiled")])
    except ValueError as exc:
        split, meta["error"] = [], str(exc)
    for e in entries:
        v, cell = VARIANTS[e["variant"]], parse_cell(e["cell"])
        row = dict(base, device=meta.get("device", base.get("device")), variant=v.name, status=v.status, impl=v.impl,
                   what=v.what, cell=cell.spec, shape=cell.shape, hq=cell.hq, hkv=cell.hkv, d=cell.d,
                   seqlen=cell.seqlen, batch=cell.batch, causal=cell.causal,
                   **{k: e[k] for k in ("configs", "event_ms", "max_err", "lpt_order") if k in e})
        ks = next((ks for job, ks in split if job is e), None)
        if not e.get("profiled") or ks is None:
            error = e.get("error") or e.get("skipped") or meta.get("error") or "not profiled"
            rows.append(dict(row, kind="error", error=error))
        else:
            rows += kernel_rows(row, ks, chosen, cell.dq_elems)
    if not entries:
        rows.append(dict(base, kind="error", error=meta.get("error", "no jobs ran")))
    return rows


# ---- the child process: one group of jobs, profiled or only compiled ----------------------------------------------
@contextlib.contextmanager
def forced(v: Variant, d: int):
    """The library as variant ``v`` runs it at head dim ``d`` (module state restored after; the memoised plans and
    tile choices are dropped before and after)."""
    from flash_attn_4_sm120 import config, config_bwd, dispatch_bwd

    tiles, relay, fused_plan = dict(config_bwd._FUSED_TILES), config_bwd.RELAY_HEAD_DIMS, dispatch_bwd.fused_plan
    consts = {name: getattr(config_bwd, name) for name, _ in v.constants}
    try:
        if v.fused_tile:
            config_bwd._FUSED_TILES[d] = ((v.fused_tile, "all"),)
        if v.relay_here:
            config_bwd.RELAY_HEAD_DIMS = relay | {d}
        if v.hide_fused:
            dispatch_bwd.fused_plan = lambda plan, device, relay=False: None
        for name, value in v.constants:
            setattr(config_bwd, name, value)
        config.clear_caches()
        dispatch_bwd.clear_caches()
        yield
    finally:
        config_bwd._FUSED_TILES.clear()
        config_bwd._FUSED_TILES.update(tiles)
        config_bwd.RELAY_HEAD_DIMS, dispatch_bwd.fused_plan = relay, fused_plan
        for name, value in consts.items():
            setattr(config_bwd, name, value)
        config.clear_caches()
        dispatch_bwd.clear_caches()


def _call(v: Variant, cell: Cell, fa, q, k, v_, gout):
    """(backward callable returning (dq, dk, dv) in (B, S, H, D), or for SDPA dk/dv per query head)."""
    import torch

    if v.impl == "ours":
        out = fa.flash_attn_func(q, k, v_, causal=cell.causal, deterministic=v.deterministic)[0]
        return lambda: torch.autograd.grad(out, (q, k, v_), gout, retain_graph=True)
    if v.impl == "sdpa_flash":
        import torch.nn.functional as F

        g = cell.hq // cell.hkv
        kk, vv = (t.detach().repeat_interleave(g, 2).requires_grad_() for t in (k, v_))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                               is_causal=cell.causal)
        gt = gout.transpose(1, 2)
        return lambda: torch.autograd.grad(o, (q, kk, vv), gt, retain_graph=True)
    from cudnn.sdpa.bwd.api_dsl import sdpa_bwd_wrapper_dsl_sm120 as frost_bwd

    out, lse = fa.flash_attn_func(q, k, v_, causal=cell.causal, return_lse=True)
    o_d, lse4 = out.detach(), lse.detach().unsqueeze(-1).contiguous()  # (B, H, S, 1), natural log
    bhsd = [t.detach().transpose(1, 2) for t in (q, k, v_, o_d, gout)]
    real = torch.cuda.get_device_capability

    def frost():
        torch.cuda.get_device_capability = lambda *a, **kw: (12, 0)
        try:
            r = frost_bwd(*bhsd, lse4, is_causal=cell.causal)
        finally:
            torch.cuda.get_device_capability = real
        return tuple(r[f"{n}_tensor"].transpose(1, 2) for n in ("dq", "dk", "dv"))
    return frost


def child_main(jobs: list[tuple[str, str]], meta_path: Path, profile: bool, deadline: float) -> int:
    import torch

    parse_cell(jobs[0][0]) if jobs else None  # puts benchmarks/ on the path
    import bench_bwd
    from bench_fwd import time_fn
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd

    built: list[str] = []
    real_kernel = dispatch_bwd._kernel

    def recording(cfg, device):  # the backward kernels a call builds (plans are dropped per job)
        built.append(cfg.name())
        return real_kernel(cfg, device)
    dispatch_bwd._kernel = recording
    meta = dict(device=torch.cuda.get_device_name(), jobs=[])
    cell_spec, tensors, refs = None, None, None
    for spec, name in jobs:
        entry = dict(cell=spec, variant=name)
        meta["jobs"].append(entry)
        v = VARIANTS[name]
        if deadline and time.time() + v.cost_s > deadline:
            entry["skipped"] = "time budget (--budget-s)"
            continue
        try:
            cell = parse_cell(spec)
            if spec != cell_spec:  # inputs and the fp32 reference once per cell
                tensors = refs = None
                g = torch.Generator(device="cuda").manual_seed(0)
                mk = lambda h: torch.randn(cell.batch, cell.seqlen, h, cell.d, device="cuda",  # noqa: E731
                                           dtype=torch.bfloat16, generator=g)
                tensors = (mk(cell.hq).requires_grad_(), mk(cell.hkv).requires_grad_(),
                           mk(cell.hkv).requires_grad_(), mk(cell.hq))
                refs = bench_bwd.reference_grads(*tensors, cell.causal)
                cell_spec = spec
            with forced(v, cell.d):
                built.clear()
                fn = _call(v, cell, fa, *tensors)
                grads = fn()
                torch.cuda.synchronize()
                entry["configs"] = sorted(set(built))
                entry["lpt_order"] = config_bwd.BWD_LPT_ORDER
                if v.expect and not re.search(v.expect, ",".join(entry["configs"])):
                    entry["error"] = f"not the variant: built {entry['configs']}, expected /{v.expect}/"
                    continue
                row = dict(hkv=cell.hkv)
                if not bench_bwd.check_grads(row, "v", grads, refs, cell.hq // cell.hkv):
                    entry["error"] = row["v_error"]
                    continue
                entry["max_err"] = row["v_max_err"]
                del grads
                if not profile:
                    continue
                entry["event_ms"] = time_fn(fn, warmup=2, iters=10)
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                torch.cuda._sleep(1000)  # the sentinel kernel
                fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                entry["profiled"] = True
        except Exception as exc:  # noqa: BLE001 - one failing variant is a row, the others still run
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    meta_path.write_text(json.dumps(meta))
    return 0


# ---- the driver --------------------------------------------------------------------------------------------------
def _run(argv, env=None, timeout=None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _output(argv, timeout=120) -> str:
    """stdout of a helper command (nvidia-smi, ncu --version, git), "" when it is missing or fails."""
    try:
        r = _run(argv, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout if r.returncode == 0 else ""


def _child_argv(jobs, meta: Path, profile: bool, deadline: float) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(jobs), "--meta", str(meta),
            "--deadline", str(deadline)] + ([] if profile else ["--no-profile"])


def compile_first(groups, workdir: Path, jobs_n: int, deadline: float) -> list[str]:
    """Every (cell, variant) of ours built in its own process without ncu, ``jobs_n`` at a time (into the disk
    cache the profiled processes load from); returns the failures' messages."""
    work = [(g, [job], workdir / f"compile_{g}_{i}.json") for g, jobs in groups if g != "peers"
            for i, job in enumerate(jobs)]

    def one(item):
        g, jobs, meta = item
        try:
            r = _run(_child_argv(jobs, meta, False, 0.0), group_env(g), timeout=max(10.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return f"{jobs[0]}: compile timed out"
        if r.returncode or not meta.exists():
            return f"{jobs[0]}: rc {r.returncode}: {r.stderr[-300:]}"
        errors = [e["error"] for e in json.loads(meta.read_text())["jobs"] if "error" in e]
        return f"{jobs[0]}: {errors[0]}" if errors else None
    with ThreadPoolExecutor(max(1, jobs_n)) as pool:
        return [m for m in pool.map(one, work) if m]


def profile_group(ncu, group, jobs, available, workdir, deadline, args) -> tuple[dict, list[dict], dict]:
    """Run one group under ncu (once more, with the next candidates, when ncu rejects metrics); (meta, kernels,
    the metrics used)."""
    meta_path = workdir / f"meta_{group}.json"
    chosen, dropped = choose_metrics(available), set()
    for attempt in range(2):
        metrics = [n for names, _ in chosen.values() for n in names]
        argv = ncu_argv(ncu, metrics, _child_argv(jobs, meta_path, True, deadline), args.kernel_regex,
                        args.launch_skip, args.launch_count or 12 * len(jobs) + 4, args.clock_control)
        meta_path.unlink(missing_ok=True)
        log = workdir / f"ncu_{group}.log"
        try:
            r = _run(argv, group_env(group), timeout=max(30.0, deadline - time.time() + 45))
        except subprocess.TimeoutExpired:
            return dict(jobs=[dict(cell=c, variant=v, error="ncu timed out") for c, v in jobs]), [], chosen
        log.write_text(" ".join(argv) + "\n" + r.stdout + "\n--- stderr ---\n" + r.stderr)
        bad = rejected_metrics(r.stdout + r.stderr, metrics)
        if bad and attempt == 0:
            dropped |= bad
            chosen = choose_metrics(available, dropped)
            continue
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
        else:  # the child died: every job is an error row
            why = f"no result from the child (ncu rc {r.returncode}, log {log}): {r.stderr[-300:]}"
            meta = dict(jobs=[dict(cell=c, variant=v, error=why) for c, v in jobs])
        if r.returncode:
            meta["error"] = f"ncu rc {r.returncode} (log {log})"
        return meta, parse_ncu_csv(r.stdout), chosen
    return dict(error="unreachable"), [], chosen


def device_tag(name: str) -> str:
    m = re.search(r"\b([A-Z]\d{3})\b", name)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS), help="shape:seqlen[:causal]")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=285.0, help="wall-clock bound of the whole run")
    ap.add_argument("--compile-jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--kernel-regex", default=".", help="ncu --kernel-name regex (the sentinel is always added)")
    ap.add_argument("--launch-skip", type=int, default=0)
    ap.add_argument("--launch-count", type=int, default=0, help="0: 12 per job")
    ap.add_argument("--clock-control", default="base", choices=("base", "none"))
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "bwd_ncu")
    ap.add_argument("--dry-run", action="store_true", help="print the groups and the ncu command, run nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--meta", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--no-profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child_main([tuple(j) for j in json.loads(args.child)], args.meta, not args.no_profile, args.deadline)
    t0 = time.time()
    deadline = t0 + args.budget_s
    cells = [parse_cell(c) for c in args.cells]
    groups = plan_groups([VARIANTS[n] for n in args.variants], cells)
    if args.dry_run:
        for g, jobs in groups:
            print(g, group_env(g), jobs)
            print(" ".join(ncu_argv(args.ncu, [n for names, _ in choose_metrics(None).values() for n in names],
                                    _child_argv(jobs, Path("meta.json"), True, deadline), args.kernel_regex)))
        return 0
    args.workdir.mkdir(parents=True, exist_ok=True)
    gpu = _output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).strip().splitlines()
    device = gpu[0] if gpu else "unknown"
    out = args.out or ROOT / "benchmarks" / "results" / f"bwd_ncu_{device_tag(device)}.jsonl"
    version = _output([args.ncu, "--version"]).strip().splitlines()
    if not version:
        print(f"profile_bwd_ncu: no Nsight Compute at {args.ncu!r} (--ncu)", file=sys.stderr)
        return 2
    available = parse_query_metrics(_output([args.ncu, "--query-metrics"]))
    chosen = choose_metrics(available)
    commit = _output(["git", "rev-parse", "--short", "HEAD"]).strip()
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    compile_errors = compile_first(groups, args.workdir, args.compile_jobs, deadline - 60)
    t_compiled = time.time() - t0
    header = dict(kind="run", run_id=run_id, device=device, commit=commit, ncu=version[-1] if version else None,
                  clock_control=args.clock_control, kernel_regex=args.kernel_regex, cells=args.cells,
                  variants=args.variants, metrics_listed=available is not None, compile_s=round(t_compiled, 1),
                  compile_errors=compile_errors, metrics={q: list(c[0]) for q, c in chosen.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(header) + "\n")
    print(json.dumps(header), flush=True)
    for group, jobs in groups:
        if time.time() > deadline - 20:  # not worth a process start
            meta, kernels, used = dict(jobs=[dict(cell=c, variant=v, skipped="time budget (--budget-s)")
                                             for c, v in jobs]), [], chosen
        else:
            meta, kernels, used = profile_group(args.ncu, group, jobs, available, args.workdir, deadline, args)
        base = dict(run_id=run_id, device=device, group=group)
        if used != chosen:  # ncu rejected one of the header's metrics: this group ran the next candidates
            base["metrics"] = {q: list(c[0]) for q, c in used.items()}
        rows = group_rows(meta, kernels, used, base)
        with out.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        for r in rows:
            if r["kind"] != "kernel":
                print(json.dumps({k: (round(x, 3) if isinstance(x, float) else x) for k, x in r.items()
                                  if k not in ("what", "kernel_full")}), flush=True)
    print(f"profile_bwd_ncu: {time.time() - t0:.0f} s (compiles {t_compiled:.0f} s), rows in {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
