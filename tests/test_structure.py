"""Structure of the package, checked on a CPU: no import cycles, host modules free of CuTe-DSL, kernels that take
their declared argument records, and the host path's memoisation and debug checks."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

from flash_attn_4_sm120 import arguments, config, dispatch, dispatch_bwd, plan as P, validate
from flash_attn_4_sm120 import validate as V
from scripts import gate_lists as GL

PKG = Path(__file__).resolve().parents[1] / "torch-ext" / "flash_attn_4_sm120"


def test_no_undefined_names():
    """Every name the package's code uses is defined (pyflakes): the launch paths run only on a GPU, so a name a
    refactor left behind would otherwise first fail there."""
    from pyflakes import api, messages, reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)
            self.found = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                self.found.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

    rep = Collect()
    for path in sorted(PKG.rglob("*.py")):
        api.check(path.read_text(), str(path), rep)
    assert not rep.found, "\n".join(rep.found)


def _module_imports() -> dict[str, set[str]]:
    """Package-internal imports of every module (relative imports resolved), by dotted name under the package."""
    graph = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        pkg_parts = parts if path.name == "__init__.py" else parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                if node.module:
                    deps.add(".".join(base + node.module.split(".")))
                else:
                    for alias in node.names:
                        deps.add(".".join(base + [alias.name]))
        graph[name] = deps
    return {n: {d for d in deps if d in graph} for n, deps in graph.items()}


def test_no_circular_imports():
    graph = _module_imports()
    state = {}

    def visit(n, stack):
        state[n] = "active"
        for d in graph[n]:
            if d == "" or d == n:
                continue
            if state.get(d) == "active":
                pytest.fail("import cycle: " + " -> ".join(stack + [n, d]))
            if d not in state:
                visit(d, stack + [n])
        state[n] = "done"

    for n in graph:
        if n not in state:
            visit(n, [])


def test_host_modules_do_not_import_cutlass_at_module_level():
    for path in PKG.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; lazy imports inside functions are the design
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels"):
                names = ["kernels"]
            for n in names:
                assert not n.startswith("cutlass"), f"{path.name} imports {n} at module level"
                assert n != "kernels", f"{path.name} imports the device code at module level"


def test_device_code_lives_in_kernels_folder():
    for path in PKG.glob("*.py"):
        assert "@cute.kernel" not in path.read_text(), f"{path.name}: kernels belong in kernels/"
    assert len(list((PKG / "kernels").glob("*.py"))) >= 8


@pytest.mark.parametrize("cls_path", [
    "fwd_tma.FlashFwdTma", "fwd_cpasync.FlashFwdCpAsync", "fwd_decode.FlashFwdDecode", "bwd_dkdv.FlashBwdDkdv", "bwd_dkdv_kvrows.FlashBwdDkdvKvRows",
    "bwd_dkdv_vregs.FlashBwdDkdvVRegs",
    "bwd_dq.FlashBwdDq",
    "bwd_preprocess.FlashBwdPreprocess", "combine.FlashCombine"])
def test_kernel_call_matches_its_record(cls_path):
    pytest.importorskip("cutlass")
    import importlib

    mod_name, cls_name = cls_path.split(".")
    # a kernel class is named after its file: Flash + the file's words (fwd_cpasync.py: FlashFwdCpAsync)
    assert cls_name.lower() == "flash" + mod_name.replace("_", ""), f"{cls_name} does not match {mod_name}.py"
    cls = getattr(importlib.import_module(f"flash_attn_4_sm120.kernels.{mod_name}"), cls_name)
    params = list(inspect.signature(cls.__call__).parameters)
    assert params[0] == "self" and params[-1] == "stream"
    assert tuple(params[1:-1]) == cls.ARGS.names


def test_fake_args_follow_the_record():
    pytest.importorskip("cutlass")
    from flash_attn_4_sm120 import jit

    tile = config.select_fwd_tile(128, 128, False)
    light = config.FwdKernelConfig("bf16", 128, 128, tile)
    heavy = GL.gate_configs("bf16", 128, 128, tile)[1]
    for cfg in (light, heavy):
        fakes = jit.fake_args(arguments.FWD_ARGS, cfg)
        assert len(fakes) == len(arguments.FWD_ARGS.names) + 1  # + stream
        by_name = dict(zip(arguments.FWD_ARGS.names, fakes))
        assert (by_name["cu_seqlens_q"] is None) == (not cfg.varlen_q)
        assert (by_name["sink"] is None) == (not cfg.has_sink)


def test_record_pack_is_by_name():
    rec = arguments.FWD_ARGS
    values = {n: i for i, n in enumerate(rec.names)}
    assert rec.pack(dict(reversed(list(values.items())))) == tuple(range(len(rec.names)))
    missing = dict(values)
    del missing["pack"]
    with pytest.raises(TypeError, match="pack"):
        rec.pack(missing)
    with pytest.raises(TypeError, match="bogus"):
        rec.pack({**missing, "bogus": 1})


def test_records_share_names_with_the_backward_launch():
    # every name the dispatcher passes exists in the record (pack would raise otherwise, at the first launch)
    src = inspect.getsource(dispatch_bwd.run_backward) + inspect.getsource(dispatch.run_forward)
    for rec in (arguments.FWD_ARGS, arguments.BWD_DKDV_ARGS, arguments.BWD_DQ_ARGS):
        for n in rec.names:
            assert f"{n}=" in src, (rec.kernel, n)


def test_tile_choice_is_memoised(monkeypatch):
    calls = []
    real = config.fwd_tile_problems
    monkeypatch.setattr(config, "fwd_tile_problems", lambda *a: calls.append(a) or real(*a))
    config.clear_caches()
    for _ in range(5):
        config.select_fwd_tile(128, 128, True)
        validate.check_head_dims(128, 128)
    first = len(calls)
    for _ in range(50):
        config.select_fwd_tile(128, 128, True)
        validate.check_head_dims(128, 128)
    assert len(calls) == first


def test_plan_is_memoised_and_follows_table_edits():
    p1 = P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, True, 0))
    assert P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, True, 0)) is p1
    assert p1.bwd_cfg is not None and p1.dq_cfg is not None
    config.clear_caches()
    assert P.get_plan(P.PlanKey("bf16", 128, 128, True, False, False, False, False, False, False, True, 0)) is not p1


def test_max_len_trusts_given_values_and_clamps_to_rows():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    assert V.max_len(cu, None, 9, "q", 7) == 7
    assert V.max_len(cu, None, 9, "q", 10**9) == 9  # never a grid larger than the rows
    assert V.max_len(None, None, 33, "k", None) == 33  # dense: the static length, no read
    with pytest.raises(ValueError, match="max_seqlen_q must be >= 0"):
        V.max_len(cu, None, 9, "q", -1)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        V.max_len(cu, None, 9, "k", "long")


def test_debug_checks_name_the_lie():
    cu = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        V.debug_check_lengths(cu, None, 2, 9, 9, "q", None)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k .*end <= 9"):
        V.debug_check_lengths(cu, None, 2, 9, 9, "k", None)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    used = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_k\[1\]=6 must be in \[0, 4\]"):
        V.debug_check_lengths(cu, used, 2, 9, 9, "k", None)
    with pytest.raises(ValueError, match="max_seqlen_q=4 is smaller than the longest sequence"):
        V.debug_check_lengths(cu, None, 2, 9, 9, "q", 4)
    V.debug_check_lengths(cu, torch.tensor([5, 4], dtype=torch.int32), 2, 9, 9, "q", 5)


def test_debug_switch_keyword_and_env(monkeypatch):
    assert V.debug_checks_enabled(True) is True
    assert V.debug_checks_enabled(False) is False
    with pytest.raises(ValueError, match="debug_checks"):
        V.debug_checks_enabled("yes")
    monkeypatch.setattr(V, "_DEBUG_ENV", [])
    monkeypatch.setenv("FA4_SM120_DEBUG_CHECKS", "1")
    assert V.debug_checks_enabled(None) is True
    monkeypatch.setenv("FA4_SM120_DEBUG_CHECKS", "0")
    assert V.debug_checks_enabled(None) is True  # read once per process


def test_every_torch_cuda_attribute_the_package_names_exists():
    """Calls like ``torch.cuda.is_current_stream_capturing()`` sit behind ``torch.cuda.is_available()``, so a misspelt
    name never runs on a CPU machine and fails only on a GPU (it did: validate.capturing).  Check every
    ``torch.cuda.<name>`` in the package's source against the installed torch."""
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "cuda" and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "torch" and not hasattr(torch.cuda, node.attr)):
                missing.append(f"{path.name}:{node.lineno} torch.cuda.{node.attr}")
    assert not missing, missing
