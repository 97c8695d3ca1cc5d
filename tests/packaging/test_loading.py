"""How users load the bundle, through kernels' public API only, each scenario in its own process and environment.

Covers local paths, LOCAL_KERNELS, online get_kernel against the local hub, the offline pitfalls of kernels 0.17.2
and how scripts/prefetch.py fixes them, publisher trust, pinned production with `kernels lock` + load_kernel,
unknown repos/revisions, and what a CPU-only machine is told. See tests/packaging/hubtools.py for the CPU workaround.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hubtools import (BUILD, PYTHON, REPO, ROOT, UNTRUSTED_REPO, assert_loaded_bundle, isolated_env, load_in_child,
                      run, script, seeded_hub)

__all__ = ["seeded_hub"]  # the fixture, imported so that pytest registers it here

CACHE_DIR = f"kernels--{REPO.replace('/', '--')}"
UNTRUSTED_MESSAGE = (f"Kernel repository '{UNTRUSTED_REPO}' is not from a trusted publisher. "
                     "Set trust_remote_code=True or add the repository ID to the trust_remote_code allowlist "
                     "to allow loading kernels from untrusted sources.")
cpu_torch_only = pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")


def offline_load(call: str, home: Path, hub, **extra) -> dict:
    """Load offline and prove that the hub saw no request meanwhile."""
    before = len(hub.requests)
    result = load_in_child(call, isolated_env(home, endpoint=hub.endpoint, offline=True, **extra))
    assert hub.requests[before:] == []
    return result


def prefetch(home: Path, hub, *args: str, **extra: str):
    return script("prefetch.py", *args, "--endpoint", hub.endpoint, env=isolated_env(home, **extra))


# -- local paths ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["", "build", "build/torch-cuda"], ids=["repo-root", "build", "variant"])
def test_get_local_kernel(tmp_path, where):
    result = load_in_child(f"kernels.get_local_kernel(Path({str(ROOT / where)!r}))", isolated_env(tmp_path))
    assert_loaded_bundle(result)
    assert Path(result["file"]) == BUILD / "torch-cuda" / "__init__.py"


def test_get_local_kernel_without_a_variant_dir(tmp_path):
    (tmp_path / "repo" / "build").mkdir(parents=True)
    result = load_in_child(f"kernels.get_local_kernel(Path({str(tmp_path / 'repo')!r}))", isolated_env(tmp_path))
    assert (result["ok"], result["type"]) == (False, "FileNotFoundError")
    assert result["message"].startswith(f"Cannot find a build variant for this system in {tmp_path / 'repo'}")


def test_local_kernels_env_overrides_the_hub(tmp_path, seeded_hub):
    before = len(seeded_hub.requests)
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint, LOCAL_KERNELS=f"{REPO}={ROOT}")
    result = load_in_child(f"kernels.get_kernel({REPO!r}, version=1)", env)
    assert_loaded_bundle(result)
    assert Path(result["file"]) == BUILD / "torch-cuda" / "__init__.py"
    assert seeded_hub.requests[before:] == []


# -- online, then offline -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def online_home(tmp_path_factory, seeded_hub):
    """A cache filled only by one online get_kernel(version=1)."""
    home = tmp_path_factory.mktemp("online")
    env = isolated_env(home, endpoint=seeded_hub.endpoint)
    result = load_in_child(f"kernels.get_kernel({REPO!r}, version=1, trust_remote_code=True)", env)
    return home, result


def test_online_get_kernel_loads_v1(online_home, seeded_hub):
    home, result = online_home
    assert_loaded_bundle(result)
    commit = seeded_hub.commits[REPO]
    assert Path(result["file"]) == home / "cache" / CACHE_DIR / "snapshots" / commit / "build/torch-cuda/__init__.py"


def test_pitfall_online_load_writes_no_ref_and_a_full_tree_listing(online_home, seeded_hub):
    home, _ = online_home
    repo_cache = home / "cache" / CACHE_DIR
    assert not (repo_cache / "refs" / "v1").exists()
    listing = json.loads((repo_cache / "trees" / f"{seeded_hub.commits[REPO]}.json").read_text())
    assert "README.md" in json.dumps(listing)  # listed, but not downloaded
    assert not (repo_cache / "snapshots" / seeded_hub.commits[REPO] / "README.md").exists()


def test_pitfall_offline_version_after_online_load_fails(online_home, seeded_hub):
    result = offline_load(f"kernels.get_kernel({REPO!r}, version=1)", online_home[0], seeded_hub)
    assert not result["ok"]
    assert result["message"].startswith(f"Version 1 of '{REPO}' is not available in the local cache")


@pytest.mark.parametrize("revision", ["commit", "v1"])
def test_pitfall_offline_revision_after_online_load_fails(online_home, seeded_hub, revision):
    revision = seeded_hub.commits[REPO] if revision == "commit" else revision
    result = offline_load(f"kernels.get_kernel({REPO!r}, revision={revision!r})", online_home[0], seeded_hub)
    assert (result["ok"], result["type"]) == (False, "FileNotFoundError")
    assert result["message"].startswith(f"Cannot find a local snapshot for {REPO} (revision: {revision})")


def test_prefetch_repairs_a_cache_filled_by_get_kernel(online_home, seeded_hub, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(online_home[0], home)
    proc = prefetch(home, seeded_hub, REPO, "--version", "1")
    assert proc.returncode == 0, proc.stderr
    assert_loaded_bundle(offline_load(f"kernels.get_kernel({REPO!r}, version=1)", home, seeded_hub))


@pytest.fixture(scope="module")
def prefetched_home(tmp_path_factory, seeded_hub):
    home = tmp_path_factory.mktemp("prefetched")
    proc = prefetch(home, seeded_hub, REPO, "--version", "1")
    assert proc.returncode == 0, proc.stderr
    return home, proc


def test_prefetch_prints_commit_and_writes_ref(prefetched_home, seeded_hub):
    home, proc = prefetched_home
    commit = seeded_hub.commits[REPO]
    assert proc.stdout.strip() == commit
    assert (home / "cache" / CACHE_DIR / "refs" / "v1").read_text().strip() == commit
    assert (home / "cache" / CACHE_DIR / "snapshots" / commit / "README.md").is_file()


@pytest.mark.parametrize("how", ["version=1", "revision=commit", "revision='v1'"])
def test_offline_loads_after_prefetch(prefetched_home, seeded_hub, how):
    how = how.replace("commit", repr(seeded_hub.commits[REPO]))
    result = offline_load(f"kernels.get_kernel({REPO!r}, {how})", prefetched_home[0], seeded_hub)
    assert_loaded_bundle(result)
    assert f"Skipping publisher trust check for '{REPO}' because Hugging Face Hub is in offline mode" in \
        result["stderr"]


def test_prefetch_and_offline_load_honour_kernels_cache(tmp_path, seeded_hub):
    cache = tmp_path / "kernels-cache"
    assert prefetch(tmp_path, seeded_hub, REPO, KERNELS_CACHE=str(cache)).returncode == 0
    assert (cache / CACHE_DIR / "refs" / "v1").is_file()
    result = offline_load(f"kernels.get_kernel({REPO!r}, version=1)", tmp_path, seeded_hub,
                          KERNELS_CACHE=str(cache))
    assert_loaded_bundle(result)
    assert Path(result["file"]).is_relative_to(cache)


def test_prefetch_refuses_offline_mode(tmp_path, seeded_hub):
    proc = prefetch(tmp_path, seeded_hub, REPO, HF_HUB_OFFLINE="1")
    assert proc.returncode == 1
    assert "HF_HUB_OFFLINE is set" in proc.stderr


# -- publisher trust ------------------------------------------------------------------------------------------------
def test_trusted_org_loads_without_trust_remote_code(tmp_path, seeded_hub):
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    result = load_in_child(f"kernels.get_kernel({REPO!r}, version=1)", env)
    assert_loaded_bundle(result)


def test_untrusted_org_is_refused_with_kernels_message(tmp_path, seeded_hub):
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    result = load_in_child(f"kernels.get_kernel({UNTRUSTED_REPO!r}, version=1)", env)
    assert (result["ok"], result["type"], result["message"]) == (False, "ValueError", UNTRUSTED_MESSAGE)
    assert not (tmp_path / "cache" / f"kernels--{UNTRUSTED_REPO.replace('/', '--')}").exists()


@pytest.mark.parametrize("trust", ["True", "[UNTRUSTED_REPO]"])
def test_untrusted_org_loads_when_trusted_explicitly(tmp_path, seeded_hub, trust):
    trust = trust.replace("UNTRUSTED_REPO", repr(UNTRUSTED_REPO))
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    assert_loaded_bundle(load_in_child(f"kernels.get_kernel({UNTRUSTED_REPO!r}, version=1, "
                                       f"trust_remote_code={trust})", env))


def test_prefetch_checks_trust_like_get_kernel(tmp_path, seeded_hub):
    refused = prefetch(tmp_path, seeded_hub, UNTRUSTED_REPO)
    assert refused.returncode == 1
    assert "not a trusted kernel publisher" in refused.stderr and "--trust-remote-code" in refused.stderr
    allowed = prefetch(tmp_path, seeded_hub, UNTRUSTED_REPO, "--trust-remote-code")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.strip() == seeded_hub.commits[UNTRUSTED_REPO]


# -- pinned production: kernels lock + load_kernel ------------------------------------------------------------------
KERNELS_CLI = str(Path(PYTHON).parent / "kernels")
# `kernels download` resolves the variant for this machine, so on CPU torch it needs the same test-only workaround.
KERNELS_CLI_WITH_CUDA = ('import sys, torch\ntorch.version.cuda = "12.8"\nfrom kernels.cli import main\n'
                         'sys.argv = ["kernels", *sys.argv[1:]]\nmain()\n')


def write_project(path: Path, repo_id: str) -> Path:
    path.mkdir(parents=True)
    (path / "pyproject.toml").write_text(f'[project]\nname = "app"\nversion = "0.1"\n\n'
                                         f'[tool.kernels.dependencies]\n"{repo_id}" = 1\n')
    return path


@pytest.fixture(scope="module")
def locked_project(tmp_path_factory, seeded_hub):
    home = tmp_path_factory.mktemp("lock")
    project = write_project(home / "app", REPO)
    proc = run([KERNELS_CLI, "lock", str(project)], isolated_env(home, endpoint=seeded_hub.endpoint))
    assert proc.returncode == 0, proc.stderr
    return home, project


def test_kernels_lock_pins_the_full_v1_commit(locked_project, seeded_hub):
    lock = json.loads((locked_project[1] / "kernels.lock").read_text())
    assert lock == [{"dependency": {"repo-id": REPO, "version": 1}, "lock": {"commit": seeded_hub.commits[REPO]}}]


def load_locked(home: Path, project: Path, hub) -> dict:
    return offline_load(f"kernels.load_kernel({REPO!r}, lockfile=Path({str(project / 'kernels.lock')!r}))", home, hub)


def test_pitfall_load_kernel_right_after_lock_fails(locked_project, seeded_hub, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(locked_project[0], home)
    result = load_locked(home, home / "app", seeded_hub)
    assert (result["ok"], result["type"]) == (False, "FileNotFoundError")
    assert result["message"].startswith("No kernel module found at")  # the lock cached only metadata.json


def test_pitfall_load_kernel_after_kernels_download_fails(locked_project, seeded_hub, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(locked_project[0], home)
    proc = run([PYTHON, "-c", KERNELS_CLI_WITH_CUDA, "download", str(home / "app")],
               isolated_env(home, endpoint=seeded_hub.endpoint))
    assert proc.returncode == 0, proc.stderr
    result = load_locked(home, home / "app", seeded_hub)
    assert (result["ok"], result["type"]) == (False, "FileNotFoundError")
    assert result["message"].startswith(f"Cannot find a local snapshot for {REPO}")


def test_prefetch_lockfile_then_load_kernel_offline(locked_project, seeded_hub, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(locked_project[0], home)
    proc = prefetch(home, seeded_hub, REPO, "--lockfile", str(home / "app" / "kernels.lock"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == seeded_hub.commits[REPO]
    assert_loaded_bundle(load_locked(home, home / "app", seeded_hub))


def test_kernels_lock_refuses_untrusted_org(tmp_path, seeded_hub):
    project = write_project(tmp_path / "app", UNTRUSTED_REPO)
    proc = run([KERNELS_CLI, "lock", str(project)], isolated_env(tmp_path, endpoint=seeded_hub.endpoint))
    assert proc.returncode != 0
    assert UNTRUSTED_MESSAGE in proc.stderr
    assert not (project / "kernels.lock").exists()


# -- unknown repos and revisions --------------------------------------------------------------------------------------
UNKNOWN = [
    ("'kernels-test/no-such-kernel', version=1", "RepositoryNotFoundError", "Repository Not Found for url"),
    (f"{REPO!r}, revision='v9'", "RevisionNotFoundError", "Revision Not Found for url"),
    (f"{REPO!r}, revision='{'0' * 40}'", "RevisionNotFoundError", "Revision Not Found for url"),
    (f"{REPO!r}, version=9", "ValueError", "Version 9 not found, available versions: 1"),
]


@pytest.mark.parametrize("args,error,message", UNKNOWN, ids=["repo", "branch", "commit", "version"])
def test_unknown_repo_or_revision_online(tmp_path, seeded_hub, args, error, message):
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    result = load_in_child(f"kernels.get_kernel({args}, trust_remote_code=True)", env)
    assert (result["ok"], result["type"]) == (False, error)
    assert message in result["message"]


def test_unknown_revision_offline(prefetched_home, seeded_hub):
    result = offline_load(f"kernels.get_kernel({REPO!r}, revision='{'1' * 40}')", prefetched_home[0], seeded_hub)
    assert (result["ok"], result["type"]) == (False, "FileNotFoundError")
    assert "Cannot find a local snapshot" in result["message"]


@pytest.mark.parametrize("args,message", [(["kernels-test/no-such-kernel", "--trust-remote-code"], "not found"),
                                          ([REPO, "--revision", "v9"], "has no revision 'v9'"),
                                          ([REPO, "--revision", "main"], "holds no kernel build")])
def test_prefetch_unknown_repo_or_revision(tmp_path, seeded_hub, args, message):
    proc = prefetch(tmp_path, seeded_hub, *args)
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


# -- CPU-only machines (no workaround) --------------------------------------------------------------------------------
CPU_ONLY = [
    ("kernels.get_kernel(REPO, version=1)", "FileNotFoundError",
     "torch-cuda: backend (cuda) does not match system backend (cpu) and is not universal"),
    ("kernels.get_kernel(REPO, version=1, backend='cuda')", "ValueError",
     "Invalid backend 'cuda', system supported backends: cpu"),
    (f"kernels.get_local_kernel(Path({str(ROOT)!r}))", "FileNotFoundError",
     "torch-cuda: backend (cuda) does not match system backend (cpu) and is not universal"),
    (f"kernels.get_local_kernel(Path({str(BUILD / 'torch-cuda')!r}))", "ValueError",
     "Kernel module `flash_attn_4_sm120` uses unsupported kernel dependency: nvidia-cutlass-dsl"),
]


@cpu_torch_only
@pytest.mark.parametrize("call,error,message", CPU_ONLY,
                         ids=["get_kernel", "backend-cuda", "local-root", "local-variant"])
def test_cpu_torch_is_told_there_is_no_variant(tmp_path, seeded_hub, call, error, message):
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    result = load_in_child(call.replace("REPO", repr(REPO)), env, cuda=False)
    assert (result["ok"], result["type"]) == (False, error)
    assert message in result["message"]


def test_backend_cuda_is_accepted_when_torch_reports_cuda(tmp_path, seeded_hub):
    """backend="cuda" only names the backend torch already has; it does not override a CPU torch (see above)."""
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint)
    assert_loaded_bundle(load_in_child(f"kernels.get_kernel({REPO!r}, version=1, backend='cuda')", env))


@pytest.mark.parametrize("trust,error,message", [
    ("False", "ValueError", "could not verify publisher trust status"),  # the overview request failed
    ("True", "LocalProtocolError", "Illegal header value b'kernels/0.17.2; hf_hub/2.4.0;"),  # trailing "; "
], ids=["trust-check", "trusted"])
def test_pitfall_disabling_telemetry_breaks_online_loads(tmp_path, seeded_hub, trust, error, message):
    env = isolated_env(tmp_path, endpoint=seeded_hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
    result = load_in_child(f"kernels.get_kernel({REPO!r}, version=1, trust_remote_code={trust})", env)
    assert (result["ok"], result["type"]) == (False, error)
    assert message in result["message"]
