"""A grid of public calls run on the CPU with the device, the compiler and the launches replaced by recorders: what
kernel configurations (and launch geometry) the host layer selects for each call, or the error it raises.

Used by tests/test_plan_grid.py against tests/data/plan_grid_main.json, recorded from main before the
plan module (aa0de83, then re-recorded at the main the plan module merged into) with ``python tests/plan_grid.py --record``: the same configurations mean the same compiled kernels
(the compile key is the config), so the SASS is unchanged without a GPU.

The stubs replace functions by identity in every loaded module of the package (whatever name a module imported them
under), so the harness does not depend on which module holds the launch sequence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import stub_device  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "plan_grid_main.json"
PKG = "flash_attn_4_sm120"
SMS = 188  # the SM count the stubbed device reports (split and decode choices read it)


@contextlib.contextmanager
def stubbed(tma: bool, calls: list):
    """CPU tensors accepted, a device with (``tma``) capabilities, compiles returning the config and launches
    appended to ``calls`` as (config, values) (the shared stub: scripts/stub_device.py)."""
    name, capability = ("SM120 (grid)", (12, 0)) if tma else ("SM86 (grid)", (8, 6))
    with stub_device.stubbed_device(name, capability, SMS, lambda cfg, dev: cfg,
                                    lambda fn, record, dev, values: calls.append((fn, values)), pkg=PKG):
        yield


_GEOMETRY = ("pack", "num_m_blocks", "num_head_groups", "num_batch", "num_n_blocks", "num_rows", "num_heads",
             "num_kv_heads", "qheads_per_kvhead")


def _record(calls) -> list:
    out = []
    for cfg, values in calls:
        out.append([repr(cfg), {k: values[k] for k in _GEOMETRY if k in values}])
    return out


def _mods(kind: str, hq: int):
    from flash_attn_4_sm120.kernels import mods

    if kind == "mask":
        return mods.causal()
    return dict(mods.alibi(), aux_tensors=[torch.zeros(hq, dtype=torch.float32)])


def _scenarios():
    """(name, kwargs builder) pairs; each builder gets (dtype, d, dv) and returns (entry point, args, kwargs,
    needs_grad)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    def dense(sq=200, sk=333, hq=4, hkv=4, grad=False, **kw):
        def build(dtype, d, dv):
            q, k, v = t(2, sq, hq, d, dtype=dtype, grad=grad), t(2, sk, hkv, d, dtype=dtype, grad=grad), \
                t(2, sk, hkv, dv, dtype=dtype, grad=grad)
            extra = {key: (val(hq) if callable(val) else val) for key, val in kw.items()}
            if "mods" in extra:
                extra.update(_mods(extra.pop("mods"), hq))
            return "flash_attn_func", (q, k, v), extra, grad
        return build

    def varlen(grad=False, seqused=False, **kw):
        def build(dtype, d, dv):
            cu = torch.tensor([0, 70, 70, 301], dtype=torch.int32)
            q, k, v = t(301, 4, d, dtype=dtype, grad=grad), t(301, 2, d, dtype=dtype, grad=grad), \
                t(301, 2, dv, dtype=dtype, grad=grad)
            extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=231, max_seqlen_k=231, **kw)
            if seqused:
                extra.update(cu_seqlens_k=None, max_seqlen_k=None, seqused_k=torch.tensor([50, 0, 200],
                                                                                            dtype=torch.int32))
                k, v = t(3, 250, 2, d, dtype=dtype, grad=grad), t(3, 250, 2, dv, dtype=dtype, grad=grad)
            return "flash_attn_varlen_func", (q, k, v), extra, grad
        return build

    def paged(page_size, sq=100, split=None, grad=False, **kw):
        def build(dtype, d, dv):
            pages = 3 * (-(-300 // page_size))
            q = t(3, sq, 8, d, dtype=dtype, grad=grad)
            k, v = t(pages, page_size, 2, d, dtype=dtype), t(pages, page_size, 2, dv, dtype=dtype)
            table = torch.randperm(pages, generator=g).to(torch.int32).view(3, -1)
            extra = dict(page_table=table, seqused_k=torch.tensor([300, 17, 250], dtype=torch.int32), **kw)
            if split is not None:
                extra["num_splits"] = split
            return "flash_attn_varlen_func", (q, k, v), extra, grad
        return build

    def kvcache(sq=1, paged=False, **kw):
        def build(dtype, d, dv):
            q = t(4, sq, 8, d, dtype=dtype)
            if paged:
                kc, vc = t(40, 16, 2, d, dtype=dtype), t(40, 16, 2, dv, dtype=dtype)
                kw2 = dict(page_table=torch.arange(40, dtype=torch.int32).view(4, 10))
            else:
                kc, vc = t(4, 160, 2, d, dtype=dtype), t(4, 160, 2, dv, dtype=dtype)
                kw2 = {}
            return "flash_attn_with_kvcache", (q, kc, vc), dict(cache_seqlens=torch.tensor(
                [5, 160, 77, 1], dtype=torch.int32), **kw2, **kw), False
        return build

    def sparse(grad=False, **kw):
        def build(dtype, d, dv):
            from flash_attn_4_sm120 import block_sparse_from_mask

            sq = sk = 300
            q, k, v = t(2, sq, 4, d, dtype=dtype, grad=grad), t(2, sk, 2, d, dtype=dtype, grad=grad), \
                t(2, sk, 2, dv, dtype=dtype, grad=grad)
            m = torch.rand(2, 4, 3, 3, generator=g) < 0.6
            extra = dict(block_sparse_tensors=block_sparse_from_mask(m, (128, 128)), **kw)
            if "mods" in extra:
                extra.update(_mods(extra.pop("mods"), 4))
            return "flash_attn_func", (q, k, v), extra, grad
        return build

    sink = lambda hq: torch.zeros(hq, dtype=torch.float32)  # noqa: E731
    return [
        ("plain", dense()),
        ("causal", dense(causal=True)),
        ("window", dense(window_size=(64, 0))),
        ("softcap", dense(softcap=30.0)),
        ("sink", dense(learnable_sink=sink)),
        ("gqa_causal", dense(hq=8, hkv=2, causal=True)),
        ("gqa_decode", dense(sq=1, sk=1000, hq=8, hkv=2)),
        ("gqa_decode4", dense(sq=4, sk=1000, hq=16, hkv=2, causal=True)),
        ("mqa_short", dense(sq=16, sk=500, hq=8, hkv=1, window_size=(100, 0))),
        ("pack_false", dense(sq=1, sk=1000, hq=8, hkv=2, pack_gqa=False)),
        ("split4", dense(sq=64, sk=2000, num_splits=4)),
        ("split_auto", dense(sq=1, sk=4000, hq=8, hkv=8, num_splits=0)),
        ("split4_prefill", dense(sq=300, sk=2000, num_splits=4, causal=True)),
        ("split3_paged_prefill", paged(64, sq=100, split=3, causal=True)),
        ("dropout", dense(dropout_p=0.1, dropout_seed=7)),
        ("dropout_gqa", dense(sq=40, hq=8, hkv=2, dropout_p=0.1, dropout_seed=7)),
        ("dropout_gqa_causal", dense(sq=40, hq=8, hkv=2, causal=True, dropout_p=0.1, dropout_seed=7)),
        ("dropout_high_p", dense(dropout_p=0.99, dropout_seed=7, causal=True)),
        ("dropout_one", dense(dropout_p=1.0)),
        ("dropout_split", dense(dropout_p=0.1, dropout_seed=7, num_splits=2)),
        ("dropout_paged", paged(16, dropout_p=0.1, dropout_seed=3)),
        ("mask_mod", dense(mods="mask")),
        ("score_mod_softcap", dense(mods="score", softcap=5.0)),
        ("score_mod_window", dense(mods="score", window_size=(32, 32))),
        ("mods_dropout", dense(mods="score", dropout_p=0.2, dropout_seed=1)),
        ("mods_split", dense(sq=8, sk=3000, mods="mask", num_splits=3)),
        ("grad_plain", dense(grad=True)),
        ("grad_causal_gqa", dense(hq=8, hkv=2, causal=True, grad=True)),
        ("grad_window_softcap", dense(window_size=(50, 10), softcap=20.0, grad=True)),
        ("grad_sink", dense(learnable_sink=sink, grad=True)),
        ("grad_deterministic", dense(causal=True, deterministic=True, grad=True)),
        ("grad_dropout", dense(dropout_p=0.1, dropout_seed=7, grad=True)),
        ("grad_dropout_gqa", dense(sq=40, hq=8, hkv=2, dropout_p=0.1, dropout_seed=7, grad=True)),
        ("grad_mods", dense(mods="score", grad=True)),
        ("grad_mask_mod_dropout", dense(mods="mask", dropout_p=0.3, dropout_seed=2, grad=True)),
        ("grad_split", dense(num_splits=2, grad=True)),
        ("grad_paged", paged(16, grad=True)),
        ("varlen", varlen(causal=True)),
        ("varlen_seqused", varlen(seqused=True, softcap=10.0)),
        ("varlen_grad", varlen(grad=True, window_size=(20, 20))),
        ("varlen_dropout_grad", varlen(grad=True, dropout_p=0.25, dropout_seed=9)),
        ("paged16", paged(16)),
        ("paged64_causal", paged(64, causal=True)),
        ("paged128", paged(128)),
        ("paged_decode", paged(64, sq=1)),
        ("paged_split", paged(64, sq=1, split=4)),
        ("paged_mods", paged(64, mods=None)),
        ("kvcache_decode", kvcache()),
        ("kvcache_paged", kvcache(paged=True, causal=True)),
        ("kvcache_split1", kvcache(sq=3, num_splits=1)),
        ("sparse", sparse(causal=True)),
        ("sparse_mask_mod", sparse(mods="mask")),
        ("sparse_grad", sparse(grad=True)),
        ("sparse_pack_true", sparse(pack_gqa=True)),
        ("sparse_dropout", sparse(dropout_p=0.1)),
        ("sparse_split", sparse(num_splits=2)),
        ("sparse_paged", sparse(page_table=torch.zeros(2, 3, dtype=torch.int32))),
    ]


DTYPES = (torch.bfloat16, torch.float16)
DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64))


def run_grid(scenario_filter=None) -> dict:
    import flash_attn_4_sm120 as fa

    results = {}
    for tma in (True, False):
        for (name, build), dtype, (d, dv) in itertools.product(_scenarios(), DTYPES, DIMS):
            if scenario_filter and name not in scenario_filter:
                continue
            if dtype is torch.float16 and (d, dv) not in ((128, 128), (64, 64)):
                continue  # fp16 shares every selection with bf16 but the dtype field: a few head dims suffice
            calls: list = []
            key = f"{'tma' if tma else 'cpasync'}/{name}/{str(dtype)[6:]}/d{d}dv{dv}"
            with stubbed(tma, calls):
                try:
                    entry, args, kw, grad = build(dtype, d, dv)
                    if "mods" in kw and kw["mods"] is None:
                        kw.pop("mods")
                        kw.update(_mods("mask", args[0].shape[-2]))
                    res = getattr(fa, entry)(*args, **kw)
                    out = res[0] if isinstance(res, tuple) else res
                    if grad:
                        ins = [x for x in args if x.requires_grad]
                        torch.autograd.grad(out, ins, torch.ones_like(out))
                    results[key] = _record(calls)
                except (ValueError, NotImplementedError) as e:
                    results[key] = {"error": type(e).__name__, "message": str(e), "launched": _record(calls)}
    return results


def compact(results: dict) -> dict:
    """{"configs": [each config's repr once], "calls": {call: [[config index, geometry], ...] or the error}}."""
    configs: dict[str, int] = {}

    def ref(launches):
        return [[configs.setdefault(cfg, len(configs)), geo] for cfg, geo in launches]

    calls = {}
    for key in sorted(results):
        r = results[key]
        calls[key] = dict(r, launched=ref(r["launched"])) if isinstance(r, dict) else ref(r)
    return {"configs": list(configs), "calls": calls}


def expand(data: dict) -> dict:
    cfgs = data["configs"]

    def deref(launches):
        return [[cfgs[i], geo] for i, geo in launches]

    return {k: dict(r, launched=deref(r["launched"])) if isinstance(r, dict) else deref(r)
            for k, r in data["calls"].items()}


if __name__ == "__main__":
    got = run_grid()
    if "--record" in sys.argv:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(compact(got), separators=(",", ":"), sort_keys=True).replace('],"', '],\n"') + "\n")
        print(f"recorded {len(got)} calls into {DATA}")
    else:
        print(json.dumps(got, indent=1)[:3000])
