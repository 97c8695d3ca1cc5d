"""The declared prebuilt set: every kernel configuration the dispatcher selects for the calls users are shown.

    python scripts/prebuilt_set.py            # rewrite torch-ext/flash_attn_4_sm120/prebuilt_set.json
    python scripts/prebuilt_set.py --check    # exit 1 when the committed set differs from a fresh derivation

The calls come from three sources, and the configurations from running the real API on them:

* the transformers scenarios of ``tests/packaging/tf_scenarios.py`` (Llama, Qwen2, Mistral, Gemma 2, gpt-oss: the dense and
  the left-padded forward, a training step, greedy ``generate`` and continuous batching ``generate_batch``), run on
  small models on the CPU; transformers' calls into the bundle are recorded and answered by the pure-PyTorch
  reference (tests/reference.py), so the models run as they do on a GPU;
* the README's usage examples (``README_CALLS`` below, checked against the README by tests/packaging/test_prebuilt.py);
* the benchmark grids (``bench_fwd.grid_cells``, forward and backward, and ``bench_decode.cases``).

Each call is replayed through the package's public functions with the device stubbed (``stubbed_device``: the
capability record of a device of the arch, its SM count, the CUDA placement check; every compiled kernel is
recorded at its launch, and neither compiled nor run), in bf16 and fp16, with the backward when the call needs
grad.  Decode tiles and the automatic split depend on the SM count, so each arch is walked for the SM counts of
its devices (``DEVICES``).  The result, per arch, is the list of compile keys (``jit.kernel_key``) the publish
step builds (``scripts/build_bundle.py --prebuilt``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch-ext" / "flash_attn_4_sm120"
SET_FILE = PACKAGE / "prebuilt_set.json"
# arch -> (name, capability, SM count) of the devices whose selections the set covers
DEVICES = {
    "sm_120a": (("RTX 5090", (12, 0), 170), ("RTX PRO 6000", (12, 0), 188), ("RTX 5080", (12, 0), 84),
                ("RTX 5070", (12, 0), 48)),
    "sm_90a": (("H100 SXM", (9, 0), 132), ("H100 PCIe", (9, 0), 114)),
}
PUBLISH_ARCHS = ("sm_120a",)  # what the publish step builds; sm_90a is listed for the proxy's proof
DTYPES = ("bf16", "fp16")
TF_REPO = "kernels-test/flash-attn-4-sm120"

# The README's usage examples, as (function, shapes, keywords); tests/packaging/test_prebuilt.py checks each `text` is in
# the README.
README_CALLS = (
    dict(text="fa.flash_attn_func(q, k, v, causal=True, return_lse=True)", fn="dense",
         q=(2, 4096, 32, 128), k=(2, 4096, 8, 128), kw=dict(causal=True, return_lse=True)),
    dict(text="fa.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens_q=cu, cu_seqlens_k=cu,",
         fn="varlen", q=(8192, 32, 128), k=(8192, 8, 128), cu=(0, 4096, 8192),
         kw=dict(max_seqlen_q=4096, max_seqlen_k=4096, window_size=(1024, 0))),
)


# -- the device stub (scripts/stub_device.py, shared with tests/plan_grid.py) ------------------------------------
@contextlib.contextmanager
def stubbed_device(arch: str, name: str, capability: tuple[int, int], num_sms: int, record: list):
    """Run the package's call path on CPU tensors as on a device of ``arch``: ``record`` gets each config the
    dispatcher launches a kernel of; nothing compiles or runs."""
    from flash_attn_4_sm120 import jit

    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import stub_device

    def compiled(cfg, dev):
        return _Stub((jit.kernel_class(cfg).__name__, cfg))

    def launched(fn, rec, dev, values):  # recorded at launch: a kernel a cache kept from another device counts too
        rec.pack(values)
        record.append((*fn.key, arch))

    with stub_device.stubbed_device(name, capability, num_sms, compiled, launched):
        yield


class _Stub:
    """What the stubbed compiler returns: the kernel's (class name, config), launched as a no-op."""

    def __init__(self, key):
        self.key = key

    def __call__(self, *args):
        return None


# -- the calls ---------------------------------------------------------------------------------------------------
def _empty(shape, dtype):
    import torch

    return torch.empty(shape, dtype=dtype)


def _dt(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def readme_calls():
    """(fn, args builder, kwargs, needs grad) of each README example."""
    import torch

    out = []
    for c in README_CALLS:
        def build(dtype, c=c):
            q, k = _empty(c["q"], dtype), _empty(c["k"], dtype)
            kw = dict(c["kw"])
            if c["fn"] == "varlen":
                cu = torch.tensor(c["cu"], dtype=torch.int32)
                kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
            return (q, k, k), kw
        out.append((c["fn"], build, False))
    return out


def bench_calls():
    """The forward and backward grid of bench_fwd / bench_bwd and the decode cases of bench_decode."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_decode
        import bench_fwd
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = []
    args = argparse.Namespace(only=None, seqlens=bench_fwd.SEQLENS)
    for _name, hq, hkv, d, s, sk, b, causal, _extra in bench_fwd.grid_cells(args):
        def build(dtype, hq=hq, hkv=hkv, d=d, s=s, sk=sk, b=b, causal=causal):
            return (_empty((b, s, hq, d), dtype), _empty((b, sk, hkv, d), dtype),
                    _empty((b, sk, hkv, d), dtype)), dict(causal=causal, return_lse=True)
        out.append(("dense", build, True))
    for _case, b, kv, hq, hkv, d, ps, sq in bench_decode.cases():
        for splits in (0, 1):
            def build(dtype, b=b, kv=kv, hq=hq, hkv=hkv, d=d, ps=ps, sq=sq, splits=splits):
                if ps:
                    kc = _empty((b * kv // ps, ps, hkv, d), dtype)
                    table = torch.arange(b * kv // ps, dtype=torch.int32).view(b, kv // ps)
                else:
                    kc, table = _empty((b, kv, hkv, d), dtype), None
                seqlens = torch.full((b,), kv, dtype=torch.int32)
                # v aliases k: the selection reads shapes only, and nothing is launched
                return (_empty((b, sq, hq, d), dtype), kc, kc), dict(
                    cache_seqlens=seqlens, page_table=table, causal=sq > 1, num_splits=splits)
            out.append(("kvcache", build, False))
    return out


def transformers_calls():
    """The calls transformers makes into the bundle in the tests' scenarios, recorded on the CPU."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "packaging"))
    sys.path.insert(0, str(ROOT / "scripts"))
    saved_cuda, saved_env = torch.version.cuda, os.environ.get("LOCAL_KERNELS")
    if torch.version.cuda is None:  # kernels picks the torch-cuda variant from it (as tests/hubtools.py does)
        torch.version.cuda = "12.8"
    calls = []
    try:
        import build_bundle
        import tf_scenarios as tf
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers import modeling_flash_attention_utils as mfau

        with tempfile.TemporaryDirectory() as tmp:
            variant = Path(tmp) / "build" / build_bundle.VARIANT
            variant.mkdir(parents=True)
            build_bundle.render_variant(ROOT, variant)
            os.environ["LOCAL_KERNELS"] = f"{TF_REPO}={Path(tmp) / 'build'}"
            for family in tf.FAMILIES:
                calls += _tf_family(tf, mfau, family, GenerationConfig, ContinuousBatchingConfig)
    finally:
        torch.version.cuda = saved_cuda
        if saved_env is None:
            os.environ.pop("LOCAL_KERNELS", None)
        else:
            os.environ["LOCAL_KERNELS"] = saved_env
        for p in (str(ROOT / "tests"), str(ROOT / "tests" / "packaging"), str(ROOT / "scripts")):
            if p in sys.path:
                sys.path.remove(p)
    return calls


def _clone(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(e) for e in x)
    return x


def _tf_family(tf, mfau, family, GenerationConfig, ContinuousBatchingConfig):
    import torch

    cfg = tf.make_config(family)
    if family == "gpt_oss":
        tf.allow_for_gpt_oss(TF_REPO)
    model = tf.build(cfg, TF_REPO, torch.bfloat16, "cpu")
    tf.install_spies(TF_REPO, reference_kernel=True)
    calls = []

    def recorder(name, fn):
        def rec(*args, **kwargs):
            grad = torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))
            saved = (_clone(args), _clone(kwargs))
            calls.append((name, lambda dtype, saved=saved: _as_dtype(saved, dtype), grad))
            return fn(*args, **kwargs)
        rec.__signature__ = getattr(fn, "__signature__", None)
        return rec

    mfau._flash_fn = recorder("dense", mfau._flash_fn)
    mfau._flash_varlen_fn = recorder("varlen", mfau._flash_varlen_fn)
    if mfau._flash_with_kvcache_fn is not None:
        mfau._flash_with_kvcache_fn = recorder("kvcache", mfau._flash_with_kvcache_fn)
    for padded in (False, True):
        ids, mask = tf.inputs(cfg, "cpu", padded)
        with torch.no_grad():
            model(ids, attention_mask=mask)
        model.train()
        labels = ids.masked_fill(mask == 0, -100)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        model.eval()
        ids, mask = tf.inputs(cfg, "cpu", padded, batch=3, seq=40)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                           pad_token_id=cfg.pad_token_id)
    prompts = [[5 + i for i in range(n)] for n in (5, 17, 40, 9)]
    gen_cfg = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=cfg.pad_token_id)
    model.generate_batch(prompts, generation_config=gen_cfg,
                         continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=False),
                         progress_bar=False)
    return calls


def _as_dtype(saved, dtype):
    import torch

    def conv(x):
        if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
            return x.to(dtype)
        return x
    args, kwargs = saved
    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


# -- the selection -------------------------------------------------------------------------------------------------
def _replay(fa, fn: str, args, kwargs, grad: bool) -> None:
    import torch

    f = {"dense": fa.flash_attn_func, "varlen": fa.flash_attn_varlen_func, "kvcache": fa.flash_attn_with_kvcache}[fn]
    if grad:
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
        kwargs = {k: (v.detach().requires_grad_() if k == "learnable_sink" and isinstance(v, torch.Tensor) else v)
                  for k, v in kwargs.items()}
    out = f(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    if grad:  # an uninitialised gradient: only the selection matters, nothing is launched
        out.backward(torch.empty_like(out))


def derive(archs=None, sources=("transformers", "readme", "bench")) -> dict[str, dict[str, tuple]]:
    """{arch: {digest: key}} of every configuration the calls select (keys as jit.kernel_key makes them)."""
    if str(ROOT / "torch-ext") not in sys.path:
        sys.path.insert(0, str(ROOT / "torch-ext"))
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import prebuilt

    calls = []
    if "transformers" in sources:
        calls += transformers_calls()
    if "readme" in sources:
        calls += readme_calls()
    if "bench" in sources:
        calls += bench_calls()
    result = {}
    for arch in archs or DEVICES:
        record: list = []
        for name, cap, sms in DEVICES[arch]:
            with stubbed_device(arch, name, cap, sms, record):
                for dtype in DTYPES:
                    for fn, build, grad in calls:
                        args, kwargs = build(_dt(dtype))
                        _replay(fa, fn, args, kwargs, grad)
        result[arch] = {prebuilt.key_digest(k): k for k in record}
    return result


def set_json(derived: dict[str, dict[str, tuple]]) -> str:
    sets = {arch: [{"digest": dg, "name": key[1].name(), "kernel": key[0], "key": repr(key)}
                   for dg, key in sorted(keys.items(), key=lambda kv: (kv[1][0], kv[1][1].name(), kv[0]))]
            for arch, keys in derived.items()}
    doc = {"about": "written by scripts/prebuilt_set.py: the configurations scripts/build_bundle.py --prebuilt "
                    "compiles into the bundle (publish_archs), per arch",
           "publish_archs": list(PUBLISH_ARCHS), "counts": {a: len(s) for a, s in sets.items()}, "sets": sets}
    return json.dumps(doc, indent=1) + "\n"


def committed() -> dict:
    return json.loads(SET_FILE.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed set is stale")
    args = ap.parse_args(argv)
    text = set_json(derive())
    if args.check:
        if SET_FILE.is_file() and SET_FILE.read_text() == text:
            print(f"{SET_FILE.relative_to(ROOT)} is up to date")
            return 0
        print(f"{SET_FILE.relative_to(ROOT)} is stale: run python scripts/prebuilt_set.py and commit it",
              file=sys.stderr)
        return 1
    SET_FILE.write_text(text)
    doc = json.loads(text)
    print(f"wrote {SET_FILE.relative_to(ROOT)}: {doc['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
