"""Host cost of this package against an older copy of it (new/old), measured so the noise of the machine cancels.

    # GPU: the old package (a copy renamed flash_attn_4_sm120_base) under DIR, both in this one process
    python benchmarks/bench_host_ab.py --path torch-ext --base-path _hostbase --out benchmarks/results/host_ab.jsonl
    # CPU, launches stubbed (scripts/stub_device.py): the host path alone, no GPU, no driver
    python benchmarks/bench_host_ab.py --cpu --path torch-ext --base-path _hostbase
    # noise-free: bytecode instructions and calls per call of both sides (CPU, stubbed)
    python benchmarks/bench_host_ab.py --cpu --count --calls 20
    # where the time goes (CPU, stubbed): cProfile of both packages on one scenario
    python benchmarks/bench_host_ab.py --cpu --path torch-ext --base-path _hostbase --profile dense

Why a second script beside bench_host.py: bench_host times 300 calls of one method, then the next, so a slow
spell of the machine (clock, another process) lands on one side; two runs of it disagreed by more than the
difference measured (benchmarks/experiments/results/host_plan_refactor_h100_s31.jsonl).  Here the two packages
alternate in blocks of ``--calls`` calls, in an order drawn at random per block, for ``--blocks`` blocks; each
block gives one new/old ratio of the two adjacent timings, and the report is the median of those ratios with its
quartiles and the share of blocks where new was faster; the same for the thread's CPU time (time.thread_time: time
the scheduler gave to other processes is not counted, the quiet measure on a shared machine), and the per-block
difference new - old in µs (a cost both sides share cancels there).  The garbage collector is off inside the timed
region (collected between blocks every so often), so a collection cannot land on one side.

Scenarios (one tiny problem each, so the GPU work is a few µs and the host cost dominates):
  dense    flash_attn_func, B=1 S=128 Hq=8 Hkv=2 D=128 bf16, causal
  varlen   flash_attn_varlen_func, the same sequence packed, cu_seqlens and max_seqlen given
  decode   flash_attn_with_kvcache, 4 queries of 1 token over a 1024-row cache, cache_seqlens a tensor
           (the automatic split: the attention and the combine launches)
  paged    flash_attn_with_kvcache, the same with a page table of 64-row pages
  fwd_bwd  flash_attn_func with requires_grad inputs, then backward
  dropout  flash_attn_func with dropout_p=0.1 and a seed
GPU timings: ``host`` stops the clock after the last call, before the block's final synchronize (what the host
spent); ``total`` includes that synchronize.  CPU timings have no device.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("dense", "varlen", "decode", "paged", "fwd_bwd", "dropout")


def make_calls(mod, device: str) -> dict:
    """{scenario: a no-argument callable} for package ``mod`` on ``device`` (inputs built once, seeded)."""
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(grad)

    s = 128
    q, k, v = t(1, s, 8, 128), t(1, s, 2, 128), t(1, s, 2, 128)
    cu = torch.tensor([0, s], dtype=torch.int32, device=device)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    gout = t(1, s, 8, 128)
    qd, kc, vc = t(4, 1, 8, 128), t(4, 1024, 2, 128), t(4, 1024, 2, 128)
    seqlens = torch.tensor([1024, 700, 300, 1], dtype=torch.int32, device=device)
    kp, vp = kc.view(64, 64, 2, 128), vc.view(64, 64, 2, 128)
    table = torch.arange(64, dtype=torch.int32, device=device).flip(0).reshape(4, 16).contiguous()

    def fwd_bwd():
        for x in (qg, kg, vg):
            x.grad = None
        out = mod.flash_attn_func(qg, kg, vg, causal=True)
        (out[0] if isinstance(out, tuple) else out).backward(gout)

    return {
        "dense": lambda: mod.flash_attn_func(q, k, v, causal=True),
        "varlen": lambda: mod.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=s, max_seqlen_k=s, causal=True),
        "decode": lambda: mod.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens),
        "paged": lambda: mod.flash_attn_with_kvcache(qd, kp, vp, cache_seqlens=seqlens, page_table=table),
        "fwd_bwd": fwd_bwd,
        "dropout": lambda: mod.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, dropout_seed=1),
    }


def _time_block(fn, calls: int, gpu: bool) -> tuple[float, float, float]:
    """(host µs/call, total µs/call, this thread's CPU µs/call) of ``calls`` back-to-back calls.  The thread's CPU
    time does not count time the scheduler gave to other processes (the quiet measure on a shared machine)."""
    if gpu:
        torch.cuda.synchronize()
    c0 = time.thread_time_ns()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    c1 = time.thread_time_ns()
    if gpu:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6, (c1 - c0) / calls / 1e3


def _quantiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=20)  # 5 % steps
    return {"median": statistics.median(xs), "p25": q[4], "p75": q[14], "p5": q[0], "p95": q[18]}


def ab(new_fn, old_fn, blocks: int, calls: int, gpu: bool, rng: random.Random) -> dict:
    """Alternate the two callables in blocks (order drawn per block); per-block ratios and per-call times."""
    new_t, old_t, ratios, ratios_total, ratios_cpu, new_c, old_c = [], [], [], [], [], [], []
    gc.collect()
    gc.disable()
    try:
        for b in range(blocks):
            got = {}
            for side in rng.sample(("new", "old"), 2):
                got[side] = _time_block(new_fn if side == "new" else old_fn, calls, gpu)
            new_t.append(got["new"][0])
            old_t.append(got["old"][0])
            ratios.append(got["new"][0] / got["old"][0])
            ratios_total.append(got["new"][1] / got["old"][1])
            new_c.append(got["new"][2])
            old_c.append(got["old"][2])
            ratios_cpu.append(got["new"][2] / got["old"][2])
            if b % 50 == 49:
                gc.collect()  # outside the timed region
    finally:
        gc.enable()
    r = _quantiles(ratios)
    return dict(ratio_host=r, ratio_total=_quantiles(ratios_total) if gpu else None,
                ratio_thread_cpu=_quantiles(ratios_cpu),
                # new - old per block in µs/call: a cost both sides share (the CPU stub's tensor check) cancels
                # here, where it pulls the ratios towards 1
                diff_thread_cpu_us=_quantiles([a - b for a, b in zip(new_c, old_c)]),
                new_faster_share=sum(x < 1 for x in ratios) / len(ratios),
                new_us=statistics.median(new_t), old_us=statistics.median(old_t),
                new_cpu_us=statistics.median(new_c), old_cpu_us=statistics.median(old_c))


def _load(name: str, path: str | None):
    if path:
        sys.path.insert(0, str(Path(path).resolve()))
    return importlib.import_module(name)


def count_work(fn, calls: int) -> dict:
    """Noise-free work of ``calls`` calls: Python bytecode instructions executed and Python/C function calls made
    (sys.settrace with opcode events, sys.setprofile for C calls), per call.  The same torch operations cost the
    same on both sides, so a host-path difference shows up here as instructions or calls, whatever the load of
    the machine."""
    counts = {"opcodes": 0, "py_calls": 0, "c_calls": 0}

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts["opcodes"] += 1
        elif event == "call":
            counts["py_calls"] += 1
        return tracer

    def profiler(frame, event, arg):
        if event == "c_call":
            counts["c_calls"] += 1

    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return {k: v / calls for k, v in counts.items()}


def _profile(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cpu", action="store_true", help="CPU tensors, device and launches stubbed (no GPU)")
    ap.add_argument("--path", default=str(ROOT / "torch-ext"), help="directory holding the new package")
    ap.add_argument("--base-path", default=str(ROOT / "_hostbase"), help="directory holding the old package")
    ap.add_argument("--module", default="flash_attn_4_sm120")
    ap.add_argument("--base-module", default="flash_attn_4_sm120_base")
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--blocks", type=int, default=400, help="A/B blocks per scenario (default 400)")
    ap.add_argument("--calls", type=int, default=10, help="calls per side per block (default 10)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls of each side first (compiles)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the block orders")
    ap.add_argument("--profile", default=None, choices=SCENARIOS, help="print cProfile of both sides instead")
    ap.add_argument("--count", action="store_true", help="count bytecode instructions and calls per call of "
                    "each side instead of timing (noise-free; use with --cpu)")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines: one row per scenario")
    args = ap.parse_args(argv)
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("bench_host_ab: no CUDA GPU (use --cpu for the stubbed host path)", file=sys.stderr)
        return 2
    if args.cpu:
        torch.set_num_threads(1)  # the CPU ops of the stubbed path on this thread: its CPU time is the whole cost
    new, old = _load(args.module, args.path), _load(args.base_module, args.base_path)
    with _stubs(args, new, old):
        return _run(args, new, old, gpu)


def _stubs(args, new, old):
    """On the CPU, both packages see a stubbed RTX 5090-like device (scripts/stub_device.py); on a GPU, nothing."""
    import contextlib

    stack = contextlib.ExitStack()
    if args.cpu:
        sys.path.insert(0, str(ROOT / "scripts"))
        import stub_device

        def compiled(cfg, dev):
            return lambda *a: None

        def launched(fn, record, dev, values):  # the argument packing a real launch does, then nothing
            fn(*record.pack(values))

        for mod in (new, old):
            stack.enter_context(stub_device.stubbed_device("stub SM120", (12, 0), 170, compiled, launched,
                                                           pkg=mod.__name__))
    return stack


def _run(args, new, old, gpu: bool) -> int:
    dev = "cuda" if gpu else "cpu"
    calls_new, calls_old = make_calls(new, dev), make_calls(old, dev)
    device_name = torch.cuda.get_device_name() if gpu else "cpu (launches stubbed)"
    if args.profile:
        for label, fn in (("new", calls_new[args.profile]), ("old", calls_old[args.profile])):
            for _ in range(args.warmup):
                fn()
            print(f"==== {label}: {args.profile}, {args.blocks * args.calls} calls")
            print(_profile(fn, args.blocks * args.calls, 30))
        return 0
    rng = random.Random(args.seed)
    rows = []
    for name in args.scenarios:
        row = dict(kind="scenario", scenario=name, device=device_name, blocks=args.blocks, calls=args.calls,
                   torch=torch.__version__)
        try:
            for fn in (calls_new[name], calls_old[name]):
                for _ in range(args.warmup):
                    fn()
            if args.count:
                row.update(kind="count", new=count_work(calls_new[name], args.calls),
                           old=count_work(calls_old[name], args.calls))
            else:
                row.update(ab(calls_new[name], calls_old[name], args.blocks, args.calls, gpu, rng))
        except Exception as exc:  # noqa: BLE001 - one failing scenario is recorded, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        _print(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 1 if any("error" in r for r in rows) else 0


def _print(row: dict) -> None:
    if "error" in row:
        print(f"{row['scenario']:<8} FAILED: {row['error']}", flush=True)
        return
    if row["kind"] == "count":
        n, o = row["new"], row["old"]
        print(f"{row['scenario']:<8} " + "  ".join(f"{k} new {n[k]:.0f} old {o[k]:.0f} ({n[k] / o[k]:.3f})"
                                                   for k in n), flush=True)
        return
    r = row["ratio_host"]
    line = (f"{row['scenario']:<8} new {row['new_us']:7.1f} µs  old {row['old_us']:7.1f} µs  new/old "
            f"{r['median']:.3f} [p25 {r['p25']:.3f}, p75 {r['p75']:.3f}; p5 {r['p5']:.3f}, p95 {r['p95']:.3f}]"
            f"  new faster in {row['new_faster_share']:.0%} of {row['blocks']} blocks")
    c = row["ratio_thread_cpu"]
    line += (f"\n{'':<8} thread CPU: new {row['new_cpu_us']:7.1f} µs  old {row['old_cpu_us']:7.1f} µs  new/old "
             f"{c['median']:.3f} [p25 {c['p25']:.3f}, p75 {c['p75']:.3f}]")
    dd = row["diff_thread_cpu_us"]
    line += f"  new-old {dd['median']:+.2f} µs [p25 {dd['p25']:+.2f}, p75 {dd['p75']:+.2f}]"
    if row.get("ratio_total"):
        line += f"  with the sync: new/old {row['ratio_total']['median']:.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
