"""Where the deterministic backward's relay waits (issue 30 item 2): runs the relay form with
``dq_relay.RELAY_PROBE = "count"``, whose waiting warps add their failed polls, their wait (64 ns units) and a count
into tables by query tile placed after the turn counters, and reports per cell: the backward's time, the warps'
summed wait against the kernel's warp-time (CTAs x 8 warps x kernel time / resident waves), and how the waits spread
over the walk (the descending walk visits query tile M-1 first, so the tile index tells the step).

    python benchmarks/experiments/probe_relay_waits.py [--cells mha-d64:4096 ...] [--timeline] [--out F]

``--timeline`` (dq_relay.TIMELINE): instead, each relay CTA's start, end and SM, for the shipped relay and its
"free" form (no waits, no fence), and from them: the kernel's span, the mean CTA duration, how many CTAs an SM runs
at once, the SMs' idle time between CTAs, and the mean duration by key tile (first, middle, last of a head's).

Timing-free otherwise: the counting form is not the shipped kernel (it adds three reds per wait).  The gradients are
checked bitwise against the shipped relay's, so the counting form keeps the ordering it measures."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["FA4_SM120_DISK_CACHE"] = "0"
os.environ["FA4_SM120_PREBUILT"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_fwd import SHAPES, TOKENS, append_jsonl, time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="*", default=["mha-d64:1024", "mha-d64:4096", "llama3-8b:4096"])
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd, jit
    from flash_attn_4_sm120.kernels import dq_relay

    config_bwd.RELAY_HEAD_DIMS = frozenset({64, 96, 128})
    slots = dq_relay.STATS_SLOTS
    holder = {}
    orig_ws = dispatch_bwd.dq_workspace

    def workspace(fcfg, batch, rows_q, hq, varlen_q, device):
        accum, turns = orig_ws(fcfg, batch, rows_q, hq, varlen_q, device)
        if turns is None or (dq_relay.RELAY_PROBE != "count" and not dq_relay.TIMELINE):
            return accum, turns
        big = torch.zeros(turns.numel() + 3 * slots + 4 * holder.get("ctas", 0), dtype=torch.int32, device=device)
        holder["stats"] = big[turns.numel():turns.numel() + 3 * slots].view(3, slots)
        holder["timeline"] = big[turns.numel() + 3 * slots:].view(-1, 4)
        return accum, big[:turns.numel()].view(turns.shape)
    dispatch_bwd.dq_workspace = workspace

    def set_probe(value):
        if value == "__reset__":  # forget compiled kernels (TIMELINE is trace time too)
            jit._MEMORY.clear()
            dispatch_bwd.clear_caches()
            return
        if dq_relay.RELAY_PROBE != value:
            jit._MEMORY.clear()
            dispatch_bwd.clear_caches()
            dq_relay.RELAY_PROBE = value

    props = torch.cuda.get_device_properties(0)
    for cell in args.cells:
        name, s = cell.split(":")
        s = int(s)
        hq, hkv, d = SHAPES[name]
        b = max(1, TOKENS // s)
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(s + d)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                       for h in (hq, hkv, hkv))
            gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            out = fa.flash_attn_func(q, k, v, causal=causal, deterministic=True)[0]

            def call():
                return torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)
            if args.timeline:
                row = timeline_row(call, set_probe, holder, dq_relay, name, s, b, d, hkv, causal, props)
                print(json.dumps(row), flush=True)
                append_jsonl(args.out, [row])
                continue
            set_probe(None)
            ref = call()
            ms = time_fn(call)
            set_probe("count")
            call()  # compile
            got = call()
            st = holder["stats"].double().cpu()
            set_probe(None)
            tile_m, tile_n = (64, 128) if d == 64 else (32, 128)
            ctas = b * hkv * -(-s // tile_n)
            m_tiles = -(-s // tile_m)
            waits, polls, wait_us = st[2].sum().item(), st[0].sum().item(), st[1].sum().item() * 64 / 1000
            by_step = [(m_tiles - 1 - m, int(st[2][m]), round(st[1][m].item() * 64 / 1000, 1))
                       for m in range(min(m_tiles, slots)) if st[2][m] > 0]
            by_step.sort()
            # a CTA's residency ~ the call's time x resident slots (2 CTAs per SM at these tiles) / CTAs
            row = dict(cell=name, seqlen=s, batch=b, causal=causal, d=d, device=props.name, relay_ms=round(ms, 4),
                       bitwise=all(torch.equal(x, y) for x, y in zip(ref, got)), ctas=ctas,
                       waiting_warps=int(waits), failed_polls=int(polls), wait_us_summed=round(wait_us, 1),
                       wait_us_per_cta=round(wait_us / 8 / ctas, 2),
                       wait_share_of_cta_time=round(wait_us / 8 / ctas / (ms * 1000 * min(1, 2 * props.multi_processor_count / ctas)), 3),
                       first_steps=by_step[:6], last_steps=by_step[-3:])
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, [row])
    return 0


def timeline_row(call, set_probe, holder, dq_relay, name, s, b, d, hkv, causal, props):
    """--timeline: the relay and its "free" form, one timed call each with the CTA table read back."""
    tile_m, tile_n = (64, 128) if d == 64 else (32, 128)
    gx = -(-s // tile_n)
    holder["ctas"] = gx * hkv * b
    row = dict(cell=name, seqlen=s, batch=b, causal=causal, d=d, device=props.name, ctas=holder["ctas"],
               timeline=True)
    for label, probe in (("relay", None), ("free", "free")):
        set_probe("__reset__")
        dq_relay.TIMELINE = True
        set_probe(probe)
        call()  # compile, warm
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        tl = holder["timeline"].long().cpu()
        done = tl[:, 3] == 1
        t0, t1, sm = tl[done, 0], tl[done, 1], tl[done, 2]
        dur = (t1 - t0).double() * 64 / 1000  # microseconds
        per_sm, gaps, overlap = {}, 0.0, 0
        for i in range(len(sm)):
            per_sm.setdefault(int(sm[i]), []).append((int(t0[i]), int(t1[i])))
        for ivs in per_sm.values():
            ivs.sort()
            busy_until = ivs[0][1]
            for a, z in ivs[1:]:
                if a < busy_until:
                    overlap += 1
                else:
                    gaps += (a - busy_until) * 64 / 1000
                busy_until = max(busy_until, z)
        lin = torch.arange(len(tl))[done]
        n = lin % gx  # plain launch order: key tile fastest (the LPT order of causal walks differs)
        by_key = {f"key{k}": round(dur[n == k].mean().item(), 1) for k in (0, gx // 2, gx - 1) if (n == k).any()}
        row.update({f"{label}_call_ms": round(start.elapsed_time(end), 4), f"{label}_ctas_recorded": int(done.sum()),
                    f"{label}_span_us": round((int(t1.max()) - int(t0.min())) * 64 / 1000, 1),
                    f"{label}_cta_mean_us": round(dur.mean().item(), 1),
                    f"{label}_cta_max_us": round(dur.max().item(), 1),
                    f"{label}_sms": len(per_sm), f"{label}_overlapping_ctas": overlap,
                    f"{label}_sm_idle_between_ctas_us_mean": round(gaps / max(len(per_sm), 1), 1),
                    f"{label}_cta_mean_us_by_key_tile": by_key})
    dq_relay.TIMELINE = False
    set_probe("__reset__")
    set_probe(None)
    return row


if __name__ == "__main__":
    sys.exit(main())
