"""scripts/publish.py against the local hub: dry run, a real upload through huggingface_hub, and refusals."""

from __future__ import annotations

import json

import pytest

from hub_server import LocalHub
from hubtools import git, isolated_env, make_project, script

REPO_ID = "kernels-test/flash-attn-4-sm120"
TOKEN = "hf_local_test_token"
PKG = "torch-ext/flash_attn_4_sm120"


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub", write_token=TOKEN) as hub:
        yield hub


@pytest.fixture
def built(tmp_path):
    """A project whose sources and fresh build are both committed: publishable."""
    project = make_project(tmp_path / "proj")
    assert script("build_bundle.py", "--root", str(project)).returncode == 0
    git(project, "add", "build")
    git(project, "commit", "-q", "-m", "build")
    return project


def publish(project, hub, *args, token=TOKEN):
    env = isolated_env(project.parent, **({"HF_TOKEN": token} if token else {}))
    return script("publish.py", "--root", str(project), "--repo-id", REPO_ID, "--endpoint", hub.endpoint, *args,
                  env=env)


def test_dry_run_prints_operations_and_contacts_nobody(built, hub):
    proc = publish(built, hub, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "main: upload README.md (from CARD.md" in proc.stdout
    assert "v1: upload build/torch-cuda/metadata.json" in proc.stdout
    assert "dry run: nothing uploaded" in proc.stdout
    assert hub.requests == []
    assert not hub.store.exists(REPO_ID)


def test_upload_lays_out_main_and_version_branch(built, hub):
    proc = publish(built, hub)
    assert proc.returncode == 0, proc.stderr
    store = hub.store
    branches = store.branches(REPO_ID)
    assert set(branches) == {"main", "v1"}
    main_files = store.files(REPO_ID, branches["main"])
    assert list(main_files) == ["README.md"]
    readme = main_files["README.md"].read_text()
    assert readme.startswith("---\nlibrary_name: kernels\nlicense: bsd-3-clause\n---\n")
    assert readme.endswith((built / "CARD.md").read_text())
    v1 = store.files(REPO_ID, branches["v1"])
    local = {f"build/{p.relative_to(built / 'build').as_posix()}": p.read_bytes()
             for p in (built / "build").rglob("*") if p.is_file()}
    assert {k: p.read_bytes() for k, p in v1.items() if k.startswith("build/")} == local
    assert f"v1 is at {branches['v1']}" in proc.stdout


def test_republish_replaces_build_and_deletes_stale_files(built, hub):
    assert publish(built, hub).returncode == 0
    first = hub.store.branches(REPO_ID)["v1"]
    (built / PKG / "extra.py").write_text("Z = 3\n")
    git(built, "add", PKG)
    git(built, "commit", "-q", "-m", "add extra")
    assert script("build_bundle.py", "--root", str(built)).returncode == 0
    git(built, "add", "build")
    git(built, "commit", "-q", "-m", "build")
    assert publish(built, hub).returncode == 0
    second = hub.store.branches(REPO_ID)["v1"]
    assert second != first
    assert "build/torch-cuda/extra.py" in hub.store.files(REPO_ID, second)

    git(built, "rm", "-q", f"{PKG}/extra.py")
    git(built, "commit", "-q", "-m", "drop extra")
    assert script("build_bundle.py", "--root", str(built)).returncode == 0
    git(built, "add", "-A", "build")
    git(built, "commit", "-q", "-m", "build")
    proc = publish(built, hub)
    assert proc.returncode == 0, proc.stderr
    assert "build/torch-cuda/extra.py" not in hub.store.files(REPO_ID, hub.store.branches(REPO_ID)["v1"])


def test_republish_of_same_build_changes_nothing(built, hub):
    assert publish(built, hub).returncode == 0
    before = hub.store.branches(REPO_ID)
    proc = publish(built, hub)
    assert proc.returncode == 0, proc.stderr
    assert hub.store.branches(REPO_ID) == before


def assert_refused(proc, hub, *fragments):
    assert proc.returncode == 1
    assert "refusing to publish" in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    assert hub.requests == []


def test_refuses_stale_build(built, hub):
    with open(built / PKG / "features.py", "a") as f:
        f.write("\n# newer than the build\n")
    git(built, "commit", "-q", "-am", "change sources, forget to rebuild")
    assert_refused(publish(built, hub, "--dry-run"), hub, "build/ is stale",
                   "run python scripts/build_bundle.py and commit build/")


def test_refuses_build_that_fails_its_digest(built, hub):
    with open(built / "build" / "torch-cuda" / "features.py", "a") as f:
        f.write("\n# edited by hand\n")
    git(built, "commit", "-q", "-am", "hand edit of the build")
    assert_refused(publish(built, hub), hub, "does not match the digest", "features.py")


def test_refuses_build_from_dirty_sources(built, hub):
    with open(built / PKG / "features.py", "a") as f:
        f.write("\n# uncommitted\n")
    assert script("build_bundle.py", "--root", str(built)).returncode == 0
    assert json.loads((built / "build/torch-cuda/metadata.json").read_text())["provenance"]["kernel"]["dirty"]
    assert_refused(publish(built, hub), hub, "built from uncommitted sources")


def test_refuses_uncommitted_build(tmp_path, hub):
    project = make_project(tmp_path / "proj")
    assert script("build_bundle.py", "--root", str(project)).returncode == 0
    assert_refused(publish(project, hub), hub, "build/ has uncommitted changes")


def test_refuses_missing_build(tmp_path, hub):
    project = make_project(tmp_path / "proj")
    assert_refused(publish(project, hub, "--dry-run"), hub, "no build to publish")


def test_refuses_card_with_front_matter(built, hub):
    (built / "CARD.md").write_text("---\nlicense: mit\n---\n# card\n")
    assert_refused(publish(built, hub, "--dry-run"), hub, "front matter")


def test_wrong_token_is_reported(built, hub):
    proc = publish(built, hub, token="hf_wrong")
    assert proc.returncode == 1
    assert "the Hub refused an upload step" in proc.stderr
    assert "HF_TOKEN" in proc.stderr
    assert not hub.store.exists(REPO_ID)
