"""Shared helpers for the bundle tests: isolated environments, child-process loads, seeded local hubs, git repos.

Every load runs in a child process with its own environment, so the HF_* variables that huggingface_hub and
kernels read at import time are honoured, and no module cache leaks between scenarios.

CPU-only machines: kernels picks its backend from ``torch.version.cuda``; a CPU build of torch makes it ``cpu`` and
the ``torch-cuda`` variant is rejected. Children started with ``cuda=True`` (the default) set
``torch.version.cuda = "12.8"`` before kernels resolves anything, so the loading path can be tested without a
GPU. This is a test-only workaround, never done in the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hub_server import LocalHub, HubStore

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
PYTHON = sys.executable
TRUSTED_ORG = "kernels-test"
UNTRUSTED_ORG = "someone-else"
REPO = f"{TRUSTED_ORG}/flash-attn-4-sm120"
UNTRUSTED_REPO = f"{UNTRUSTED_ORG}/flash-attn-4-sm120"
README = b"---\nlibrary_name: kernels\nlicense: bsd-3-clause\n---\n\n# flash-attn-4-sm120 (test card)\n"
# test-only: lets kernels pick the cuda backend on CPU torch
CUDA_PRELUDE = 'import torch\ntorch.version.cuda = "12.8"\n'
# Files of the repository that a temporary copy needs to build and publish.
PROJECT_FILES = ("build.toml", "CARD.md", ".gitignore", "torch-ext")


def isolated_env(home: Path, *, endpoint: str | None = None, offline: bool = False, **extra: str) -> dict[str, str]:
    """os.environ without HF_*/KERNELS_*/LOCAL_KERNELS, with a private HF home and cache under `home`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_", "KERNELS_")) and k != "LOCAL_KERNELS"}
    env.update(HF_HOME=str(home / "hf_home"), HF_HUB_CACHE=str(home / "cache"), HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONDONTWRITEBYTECODE="1", PYTHONWARNINGS="ignore")
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 180
        ) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)


def load_in_child(call: str, env: dict[str, str], *, cuda: bool = True, python: str = PYTHON,
                  cwd: Path | None = None) -> dict:
    """Run `m = <call>` (kernels imported as `kernels`, Path available) in a fresh interpreter.

    Returns {"ok": True, "name", "version", "features", "file", "missing_exports"} or
    {"ok": False, "type", "message"}; both with the child's "stderr".
    """
    code = (CUDA_PRELUDE if cuda else "") + textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        import kernels
        try:
            m = {call}
        except Exception as e:
            print(json.dumps({{"ok": False, "type": type(e).__name__, "message": str(e)}}))
            sys.exit(0)
        print(json.dumps({{"ok": True, "name": m.__name__, "version": m.__version__,
                          "features": sorted(m.FEATURES), "file": m.__file__,
                          "missing_exports": [n for n in getattr(m, "__all__", []) if not hasattr(m, n)]}}))
        """)
    proc = run([python, "-c", code], env, cwd=cwd)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(lines[-1])
    result["stderr"] = proc.stderr
    return result


def build_metadata(build_dir: Path = BUILD) -> dict:
    return json.loads((build_dir / "torch-cuda" / "metadata.json").read_text())


def assert_loaded_bundle(result: dict, build_dir: Path = BUILD) -> None:
    """The child loaded our bundle: its module name is the metadata id, version and FEATURES are there."""
    assert result["ok"], f"load failed: {result.get('type')}: {result.get('message')}\n{result.get('stderr', '')}"
    meta = build_metadata(build_dir)
    assert result["name"] == meta["id"]
    assert result["version"].split(".")[0] == str(meta["version"])
    assert "forward" in result["features"]
    assert result["missing_exports"] == []


def seed_bundle(store: HubStore, repo_id: str, build_dir: Path = BUILD, *, trusted: bool = True) -> str:
    """Publish `build_dir` the way publish.py lays it out: README on main, README + build/ on branch v1."""
    store.create_repo(repo_id)
    store.set_trust(repo_id.split("/")[0], trusted)
    return store.seed_build(repo_id, build_dir, README)


@pytest.fixture(scope="module")
def seeded_hub(tmp_path_factory):
    """A running local hub with the committed build at REPO (trusted org) and UNTRUSTED_REPO."""
    hub = LocalHub(tmp_path_factory.mktemp("hub"))
    hub.commits = {REPO: seed_bundle(hub.store, REPO), UNTRUSTED_REPO: seed_bundle(hub.store, UNTRUSTED_REPO,
                                                                                    trusted=False)}
    with hub:
        yield hub


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com",
                           *args], check=True, capture_output=True, text=True).stdout


def make_project(dest: Path, *, commit: bool = True) -> Path:
    """A fresh git repository holding this project's committed sources (not its build, nor work in progress)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD", *PROJECT_FILES],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    git(dest, "init", "-q", "-b", "main")
    if commit:
        git(dest, "add", "-A")
        git(dest, "commit", "-q", "-m", "sources")
    return dest


def script(name: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
           ) -> subprocess.CompletedProcess:
    """Run scripts/<name> of this checkout with the test interpreter."""
    return run([PYTHON, str(ROOT / "scripts" / name), *args], env if env is not None else dict(os.environ), cwd=cwd)


# -- transformers scenarios (tests/packaging/tf_scenarios.py runs in the child) ----------------------------------
TF_SCENARIOS = Path(__file__).resolve().parent / "tf_scenarios.py"


def run_tf_scenario(hub: LocalHub, home: Path, scenario: str, *args: str, timeout: float = 900) -> dict:
    """Run one tests/packaging/tf_scenarios.py scenario against `hub` in a fresh interpreter and return its JSON result.

    The child sees the transformers that this interpreter imports (its folder goes on PYTHONPATH when it is not one
    of the interpreter's own site-packages, e.g. an extra payload), the local hub as HF_ENDPOINT and a private HF
    home; a failed scenario is raised with the child's traceback and stderr."""
    import site

    import transformers

    env = isolated_env(home, endpoint=hub.endpoint)
    tf_dir = str(Path(transformers.__file__).resolve().parent.parent)
    if tf_dir not in {str(Path(p).resolve()) for p in site.getsitepackages()}:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tf_dir, env.get("PYTHONPATH")) if p)
    proc = run([PYTHON, str(TF_SCENARIOS), scenario, *args], env, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario child failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    result = json.loads(lines[-1])
    if not result["ok"]:
        raise AssertionError(f"scenario {scenario} {' '.join(args)} raised {result['type']}: {result['message']}\n"
                             f"{result['traceback']}\n--- child stderr ---\n{proc.stderr[-6000:]}")
    result["stderr"] = proc.stderr
    return result
