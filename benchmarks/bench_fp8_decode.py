"""FP8 KV-cache decode benchmark (issue 34, item 2): flash_attn_with_kvcache with a bf16 query over an e4m3 cache,
against our bf16 cache and PyTorch's SDPA, in one process.

    python benchmarks/bench_fp8_decode.py      # writes benchmarks/results/fp8_decode_<gpu>.jsonl (< 4 min)

Cases: q_len 1, Hq 32 / Hkv 8, d128, contiguous cache, every key valid; B = 1 and 8, KV 4K / 16K / 32K, and
issue 34's cells B = 8 KV 8K and B = 64 KV 2K.
  * ``bf16``      the bf16 cache, our default call (num_splits=0: automatic split-KV);
  * ``fp8``       the e4m3 cache (per (batch, KV head) descales) with the bf16 query: what this feature serves,
                  the default call (packed GQA and automatic split-KV, as the bf16 cache); the kernel reads the
                  bf16 query and quantizes each (row, head) itself (config_fp8 ``q_dtype``), so nothing runs before
                  it on the host;
  * ``fp8_unsplit`` the same with num_splits=1 (packed GQA only): what the split adds;
  * ``fp8_e4m3q`` the same cache with a query quantized beforehand (per (batch, KV head), q_descale given): the
                  e4m3-query kernel alone, the quantization not timed;
  * ``sdpa``      torch.nn.functional.scaled_dot_product_attention on (B, H, S, D) copies of the bf16 cache
                  (enable_gqa; whichever backend PyTorch picks).
  * ``bf16_p16`` / ``fp8_p16`` (issue 34's cells only, PAGED_CELLS): the same bf16 / e4m3 caches scattered over
                  shuffled pages of 16 rows (page_table, as a serving engine's allocator leaves them), default
                  calls; ``fp8_p16_bitwise`` records whether the paged output equals the contiguous one bit for bit
                  (it must: the paged kernel differs only in addresses).
Times: median ms of CUDA-graph replays of one call after warm-up (bench_decode.time_graph: CUDA events).  GB/s
counts the bytes of K and V each call reads (e4m3: half the bf16 bytes); pct_of_copy divides by a device-to-device
copy's rate measured in the same run (issue 34's "80% of copy bandwidth, counting FP8 bytes" is fp8_pct_of_copy).

Checked before timing, against an fp32 reference in plain torch of the UNquantized bf16 q/k/v
(benchmarks/refcheck.py): bf16 and sdpa with the tests' bar (2x the error of the same computation in bf16, plus a
small atol); the FP8 rows with tests/test_fp8_kvcache_gpu.py's bars (RMS error at most 1.1x that of the step-by-step
emulation, tests/fp8_emulation.py, of the same quantized inputs, and within a fifth of that error of the emulation).
A failing result is recorded as ``<impl>_error`` and not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_decode import copy_gbps, gpu_tag, time_graph  # noqa: E402  (shared timing and device tag)
import refcheck  # noqa: E402  (fp32 reference in plain torch)
from tests.fp8_emulation import emulate_fp8_attention, quantize_rows, rms  # noqa: E402  (the FP8 forward's model)

HQ, HKV, D = 32, 8, 128
SHAPES = tuple((b, kv) for b in (1, 8) for kv in (4096, 16384, 32768)) + ((8, 8192), (64, 2048))  # + issue 34's
PAGED_CELLS = ((8, 8192), (64, 2048))  # issue 34's decode cells, also run paged
PAGE_SIZE = 16


def page_table(b, s, gen):
    """(B, S / PAGE_SIZE) int32: every page of a pool of B x S / PAGE_SIZE, shuffled (an allocator's scatter)."""
    width = s // PAGE_SIZE
    return torch.randperm(b * width, device="cuda", generator=gen).view(b, width).to(torch.int32)


def paged(cache, table):
    """The cache's rows in a pool (pages, PAGE_SIZE, Hkv, D): sequence b's key j at row j % PAGE_SIZE of page
    table[b, j // PAGE_SIZE]."""
    b, width = table.shape
    pool = torch.empty((b * width, PAGE_SIZE) + tuple(cache.shape[2:]), dtype=cache.dtype, device=cache.device)
    raw = cache.view(torch.uint8)  # bytes: a bf16 cache's last dim doubles in this view
    pool.view(torch.uint8)[table.long()] = raw.view(b, width, PAGE_SIZE, *raw.shape[2:])
    return pool


def emulate(q8, qd, k8, v8, kd, vd, q_rows=False):
    """(emulated output, RMS that P's rounding puts into it) per batch entry (one at a time: it expands K/V to
    every query head in fp32).  ``q_rows``: qd is per (row, head) (the kernel's own quantization of a bf16 q)."""
    res = []
    for i in range(q8.shape[0]):
        args = (q8[i:i + 1], k8[i:i + 1], v8[i:i + 1], qd[i:i + 1], kd[i:i + 1], vd[i:i + 1])
        p_rms = rms(*(emulate_fp8_attention(*args, quantize_p=p, out_dtype=torch.float32, q_rows=q_rows)
                      for p in (True, False)))
        res.append((emulate_fp8_attention(*args, q_rows=q_rows), p_rms))
    return res


def fp8_check(out, ref32, emus):
    """(problem or None, err, err_emu): the tests' bars, per batch entry (tests/test_fp8_kvcache_gpu.py's: the
    kernel-emulation gap may add twice P's rounding RMS, as a split rounds P against its own running max)."""
    worst = (0.0, 0.0)
    for i, (emu, p_rms) in enumerate(emus):
        sl = slice(i, i + 1)
        err, err_emu, gap = rms(out[sl], ref32[sl]), rms(emu, ref32[sl]), rms(out[sl], emu)
        worst = max(worst, (err, err_emu))
        if not (err <= 1.1 * err_emu and gap <= 0.2 * err_emu + 2 * p_rms):
            return f"batch {i}: rms {err:.3e}, emulation's {err_emu:.3e}, kernel-emulation {gap:.3e}", err, err_emu
    return None, *worst


def run_case(fa, Q, b, kv, copy_bw):
    gen = torch.Generator(device="cuda").manual_seed(b * 100003 + kv)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, k8, v8, _, kd, vd = Q.quantize_qkv(q, kc, vc)  # per (batch, KV head) cache descales
    q8, qd = Q.quantize_query(q, HKV)
    seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
    bf16_bytes = 2 * b * kv * HKV * D * 2
    # fp8_query: how the default FP8 call quantizes the bf16 query (scripts/readme_sections.py words the table)
    row = dict(batch=b, kv_len=kv, q_len=1, hq=HQ, hkv=HKV, d=D, bf16_kv_bytes=bf16_bytes, fp8_query="kernel_rows",
               fp8_kv_bytes=bf16_bytes // 2, copy_gbps=copy_bw, device=torch.cuda.get_device_name())
    ref32 = refcheck.forward(q, kc, vc, False)
    ref16 = refcheck.forward(q, kc, vc, False, dtype=q.dtype)
    kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()  # SDPA's (B, Hkv, S, D)
    qt = q.transpose(1, 2)
    impls = {
        "bf16": (lambda: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens), bf16_bytes),
        "fp8": (lambda: fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd, v_descale=vd),
                bf16_bytes // 2),
        "fp8_unsplit": (lambda: fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd,
                                                           v_descale=vd, num_splits=1), bf16_bytes // 2),
        "fp8_e4m3q": (lambda: fa.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, q_descale=qd,
                                                         k_descale=kd, v_descale=vd), bf16_bytes // 2),
        "sdpa": (lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                 .transpose(1, 2), bf16_bytes),
    }
    if (b, kv) in PAGED_CELLS:  # the same bytes over the same shuffled pages, bf16 and e4m3
        table = page_table(b, kv, gen)
        kp, vp, k8p, v8p = (paged(x, table) for x in (kc, vc, k8, v8))
        impls["bf16_p16"] = (lambda: fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, page_table=table),
                             bf16_bytes)
        impls["fp8_p16"] = (lambda: fa.flash_attn_with_kvcache(q, k8p, v8p, cache_seqlens=seqlens, page_table=table,
                                                               k_descale=kd, v_descale=vd), bf16_bytes // 2)
    emus = {}  # per query quantization: the kernel's per-row one (bf16 q) and the host's (fp8_e4m3q)
    for label, (fn, nbytes) in impls.items():
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - an implementation failing a cell is recorded, not fatal
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if label.startswith("fp8"):
            host_q = label == "fp8_e4m3q"
            if host_q not in emus:  # computed once for every row of the same query quantization
                emus[host_q] = (emulate(q8, qd, k8, v8, kd, vd) if host_q
                                else emulate(*quantize_rows(q), k8, v8, kd, vd, q_rows=True))
            problem, err, err_emu = fp8_check(out, ref32, emus[host_q])
            row[f"{label}_rms_err"], row[f"{label}_emulation_rms_err"] = err, err_emu
        else:
            err, bar, problem = refcheck.check("out", out, ref32, ref16)
            row[f"{label}_max_err"], row[f"{label}_check_bar"] = err, bar
        if label == "fp8_p16":
            contiguous = impls["fp8"][0]()
            row["fp8_p16_bitwise"] = bool(torch.equal(out, contiguous))
        if problem:
            row[f"{label}_error"] = "check failed: " + problem
            continue
        ms = time_graph(fn)
        row[f"{label}_ms"] = ms
        row[f"{label}_gbps"] = nbytes / ms / 1e6
        row[f"{label}_pct_of_copy"] = row[f"{label}_gbps"] / copy_bw
    for label in ("fp8", "fp8_unsplit", "fp8_e4m3q", "sdpa"):
        if f"{label}_ms" in row and "bf16_ms" in row:
            row[f"{label}_speedup_vs_bf16"] = row["bf16_ms"] / row[f"{label}_ms"]
    if "fp8_p16_ms" in row and "bf16_p16_ms" in row:  # paged over paged: issue 34's "paged with page size 16"
        row["fp8_p16_speedup_vs_bf16_p16"] = row["bf16_p16_ms"] / row["fp8_p16_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_decode: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import fp8_quant as Q

    copy_bw = copy_gbps()
    print(json.dumps({"copy_gbps": round(copy_bw, 1), "device": torch.cuda.get_device_name()}), flush=True)
    rows = []
    with torch.no_grad():
        for b, kv in SHAPES:
            row = run_case(fa, Q, b, kv, copy_bw)
            torch.cuda.empty_cache()  # the case's caches and SDPA copies are gone with run_case's frame
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = args.out or HERE / "results" / f"fp8_decode_{gpu_tag()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
