"""Forward benchmark: ours vs the same-instruction peers, in one process on one GPU.

    python benchmarks/bench_fwd.py --out benchmarks/results/fwd_h100.jsonl

Peers (each skipped, with a note, when not installed):
  sdpa_flash   PyTorch SDPA, FLASH backend (FlashAttention-2); GQA K/V expanded outside the timed region
  fa4_sm120    upstream flash-attn-4 (flash_attn.cute) with its SM120 path forced (_get_device_arch -> 120)
  cudnn_sm80   NVIDIA cuDNN-frontend's CuTe-DSL mma.sync kernel (sdpa_fwd_wrapper_sm80), run by presenting
               compute capability 8.0 during the call
TFLOPS by the FlashAttention convention: 4*B*Hq*S^2*D (halved when causal) / median time of CUDA-event
timed calls after warm-up.  Grid: llama3-8b 32/8/128, qwen2.5-7b 28/4/128, mha-d64 16/16/64, mha-d256 8/8/256,
S in {1024, 4096, 16384}, B*S = 16384, causal off/on.  Issue 11's added cells (``extra``, outside the grid's
geomeans; only without --only): 70B-class GQA 64/8/128 at S=2K, d=96 at S=2K, d=256 GQA 16/8 at S=4K, causal off
and on, and a chunked-prefill cell: 512 new queries over 8K keys, llama3-8b heads, causal aligned bottom-right
(FLOPs: the unmasked query-key pairs, 512 * 7680 + 512^2 / 2 per head).  SDPA's is_causal aligns top-left, so
SDPA FLASH has no like-for-like chunked cell.  Before it is timed, every output (ours and each peer's) is checked
against an fp32 reference computed in plain torch (benchmarks/refcheck.py) on batch entry 0 and KV head 0 with its
query heads, with the tests' bar; a result that fails is an error row (``<impl>_error``), never timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "llama3-8b": (32, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "mha-d64": (16, 16, 64),
    "mha-d256": (8, 8, 256),
}
SEQLENS = (1024, 4096, 16384)
TOKENS = 16384
# issue 11's cells beyond the grid: (Hq, Hkv, D, S), batch TOKENS // S
EXTRA_CELLS = {"llama3-70b": (64, 8, 128, 2048), "mha-d96": (16, 16, 96, 2048), "gqa-d256": (16, 8, 256, 4096)}
# chunked prefill: (Hq, Hkv, D, new queries, keys, batch), causal bottom-right (the forward only: see bench_bwd.py)
CHUNKED_CELL = ("chunked-prefill", (32, 8, 128, 512, 8192, 4))


def load_ours():
    import flash_attn_4_sm120 as fa

    return fa


def time_fn(fn, warmup=3, iters=20) -> float:
    """Median milliseconds of ``iters`` CUDA-event timed calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def append_jsonl(path: Path | None, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as JSON lines (nothing when ``path`` is None); the probes' ``--out``."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def flops(b, hq, s, d, causal):
    f = 4.0 * b * hq * s * s * d
    return f / 2 if causal else f


@contextlib.contextmanager
def capability(cap):
    orig = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: cap
    try:
        yield
    finally:
        torch.cuda.get_device_capability = orig


def make_peers(notes: list[str]):
    peers = {}

    def sdpa(q, k, v, causal):
        hq, hkv = q.shape[2], k.shape[2]
        qt = q.transpose(1, 2)
        kt = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2) if hq != hkv else k.transpose(1, 2)
        vt = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2) if hq != hkv else v.transpose(1, 2)

        def run():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return run

    peers["sdpa_flash"] = sdpa
    try:
        import flash_attn.cute.interface as fi
        from flash_attn.cute import flash_attn_func as fa4_func

        fi._get_device_arch = lambda: 120  # force upstream's SM120 path (its SM80 kernel) on any GPU

        def fa4(q, k, v, causal):
            return lambda: fa4_func(q, k, v, causal=causal)

        peers["fa4_sm120"] = fa4
    except Exception as exc:  # noqa: BLE001 - report and skip the peer
        notes.append(f"fa4_sm120 skipped: flash-attn-4 not importable ({type(exc).__name__}: {exc})")
    try:
        from cudnn.sdpa.fwd import sdpa_fwd_wrapper_sm80

        def cudnn80(q, k, v, causal):
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

            def run():
                with capability((8, 0)):
                    return sdpa_fwd_wrapper_sm80(qt, kt, vt, is_causal=causal)

            return run

        peers["cudnn_sm80"] = cudnn80
    except Exception as exc:  # noqa: BLE001
        notes.append(f"cudnn_sm80 skipped: nvidia-cudnn-frontend not importable ({type(exc).__name__}: {exc})")
    return peers


def reference_group(q, k, v, causal):
    """fp32 and same-dtype references (benchmarks/refcheck.py, plain torch: independent of every kernel timed) of
    batch entry 0, KV head 0 and its query heads."""
    import refcheck

    g = q.shape[2] // k.shape[2]
    sub = (q[:1, :, :g], k[:1, :, :1], v[:1, :, :1])
    return refcheck.forward(*sub, causal), refcheck.forward(*sub, causal, dtype=q.dtype)


def checked(row, name, out, refs) -> bool:
    """Check ``out`` ((B, S, H, D), or (B, H, S, D), transposed here) against the references of ``reference_group``:
    records ``<name>_max_err`` and ``check_bar``, or ``<name>_error`` (then the caller does not time it)."""
    import refcheck

    r32 = refs[0]
    if out.shape[1] != r32.shape[1]:
        out = out.transpose(1, 2)
    err, bar, problem = refcheck.check("out", out[:1, :, :r32.shape[2]], *refs)
    row["check_bar"] = bar
    if problem:
        row[f"{name}_error"] = "check failed: " + problem
        return False
    row[f"{name}_max_err"] = err
    return True


def chunked_flops(b, hq, sq, sk, d):
    """FLOPs of a causal call whose sq queries are the last of sk keys (bottom-right): the unmasked pairs, with
    the square part halved as the FlashAttention convention halves a causal square."""
    return 4.0 * b * hq * d * (sq * (sk - sq) + sq * sq / 2)


def grid_cells(args):
    """(shape name, hq, hkv, d, seqlen_q, seqlen_k, batch, causal, extra) of every cell to run."""
    cells = [(name, hq, hkv, d, s, s, max(1, TOKENS // s), causal, False)
             for name, (hq, hkv, d) in SHAPES.items() if not args.only or name in args.only
             for s in args.seqlens for causal in (False, True)]
    if not args.only:
        cells += [(name, hq, hkv, d, s, s, max(1, TOKENS // s), causal, True)
                  for name, (hq, hkv, d, s) in EXTRA_CELLS.items() for causal in (False, True)]
        name, (hq, hkv, d, sq, sk, b) = CHUNKED_CELL
        cells.append((name, hq, hkv, d, sq, sk, b, True, True))
    return cells


def run_grid(args, fa, peers, notes):
    rows = []
    dev = torch.cuda.get_device_name()
    for shape_name, hq, hkv, d, s, sk, b, causal, extra in grid_cells(args):
        chunked = sk != s
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        fl = chunked_flops(b, hq, s, sk, d) if chunked else flops(b, hq, s, d, causal)
        row = dict(shape=shape_name, hq=hq, hkv=hkv, d=d, seqlen=s, batch=b, causal=causal, device=dev,
                   extra=extra)
        if chunked:
            row["seqlen_k"] = sk
        ours = lambda: fa.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        refs = reference_group(q, k, v, causal)
        if checked(row, "ours", ours()[0], refs):  # a failed check is an error row, never timed
            row["ours_ms"] = time_fn(ours)
            row["ours_tflops"] = fl / row["ours_ms"] / 1e9
        for name, make in peers.items():
            if chunked and name == "sdpa_flash":
                row["sdpa_flash_error"] = "n/a: SDPA's is_causal aligns top-left (no bottom-right option)"
                continue
            try:
                fn = make(q, k, v, causal)
                out = fn()
                out = out[0] if isinstance(out, (tuple, list)) else out
                if hasattr(out, "get") and not isinstance(out, torch.Tensor):
                    out = out["o_tensor"]
                if not checked(row, name, out, refs):
                    continue
                ms = time_fn(fn)
                row[f"{name}_ms"] = ms
                row[f"{name}_tflops"] = fl / ms / 1e9
            except Exception as exc:  # noqa: BLE001 - a peer failing one cell is recorded, not fatal
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        peer_best = max((row[f"{n}_tflops"] for n in peers if f"{n}_tflops" in row), default=None)
        if peer_best and "ours_tflops" in row:
            row["ratio_vs_best_peer"] = row["ours_tflops"] / peer_best
        if "sdpa_flash_tflops" in row and "ours_tflops" in row:
            row["ratio_vs_sdpa_flash"] = row["ours_tflops"] / row["sdpa_flash_tflops"]
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
    return rows


def summary(rows):
    def geo(xs):
        xs = [x for x in xs if x]
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    extra = [r for r in rows if r.get("extra")]
    rows = [r for r in rows if not r.get("extra")]  # the 24-cell grid
    out = {
        "geomean_vs_best_peer": geo([r.get("ratio_vs_best_peer") for r in rows]),
        "min_vs_best_peer": min((r["ratio_vs_best_peer"] for r in rows if "ratio_vs_best_peer" in r), default=None),
        "geomean_vs_sdpa_flash": geo([r.get("ratio_vs_sdpa_flash") for r in rows]),
        "best_cell_tflops": max((r["ours_tflops"] for r in rows if "ours_tflops" in r), default=None),
    }
    for name in ("sdpa_flash", "fa4_sm120", "cudnn_sm80"):
        out[f"geomean_vs_{name}"] = geo([r["ours_tflops"] / r[f"{name}_tflops"] for r in rows
                                         if f"{name}_tflops" in r and "ours_tflops" in r])
    if extra:
        out["extra_geomean_vs_best_peer"] = geo([r.get("ratio_vs_best_peer") for r in extra])
        out["extra_min_vs_best_peer"] = min((r["ratio_vs_best_peer"] for r in extra if "ratio_vs_best_peer" in r),
                                            default=None)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="shape names")
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fwd: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    notes: list[str] = []
    fa = load_ours()
    peers = make_peers(notes)
    for n in notes:
        print("note:", n, flush=True)
    t0 = time.time()
    rows = run_grid(args, fa, peers, notes)
    summ = summary(rows)
    summ.update(kind="summary", device=torch.cuda.get_device_name(), notes=notes, seconds=round(time.time() - t0, 1),
                torch=torch.__version__)
    print(json.dumps(summ), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows + [summ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
