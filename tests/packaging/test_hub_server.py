"""The local hub fixture answers like the Hub: headers, git blob oids, error codes, uploads via huggingface_hub."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from hub_server import LocalHub

REPO = "org/kernel"


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub") as hub:
        hub.store.create_repo(REPO)
        hub.store.set_trust("org", True)
        hub.store.commit(REPO, "main", {"README.md": b"# card\n"})
        hub.store.create_branch(REPO, "v1")
        hub.commit = hub.store.commit(REPO, "v1", {"build/torch-cuda/__init__.py": b"X = 1\n",
                                                   "build/torch-cuda/metadata.json": b"{}\n"})
        yield hub


def get(hub, path, method="GET"):
    request = urllib.request.Request(hub.endpoint + path, method=method)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_resolve_headers_and_blob_oid_match_git(hub, tmp_path):
    status, headers, body = get(hub, f"/kernels/{REPO}/resolve/v1/build/torch-cuda/__init__.py", method="HEAD")
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == hub.commit and headers["Content-Length"] == "6"
    (tmp_path / "blob").write_bytes(b"X = 1\n")
    git_oid = subprocess.run(["git", "hash-object", str(tmp_path / "blob")], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert headers["ETag"] == f'"{git_oid}"'
    tree = json.loads(get(hub, f"/api/kernels/{REPO}/tree/{hub.commit}?recursive=true")[2])
    assert {"type": "file", "oid": git_oid, "size": 6, "path": "build/torch-cuda/__init__.py"} in tree


def test_tree_listing_of_build_shows_variant_directories(hub):
    status, _, body = get(hub, f"/api/kernels/{REPO}/tree/v1/build?recursive=false&expand=false")
    assert status == 200
    assert [(e["type"], e["path"]) for e in json.loads(body)] == [("directory", "build/torch-cuda")]


def test_refs_revision_and_org_overview(hub):
    refs = json.loads(get(hub, f"/api/kernels/{REPO}/refs")[2])
    assert {b["name"]: b["targetCommit"] for b in refs["branches"]}["v1"] == hub.commit
    assert json.loads(get(hub, f"/api/kernels/{REPO}/revision/v1")[2])["sha"] == hub.commit
    assert json.loads(get(hub, "/api/organizations/org/overview")[2])["trustedKernelPublisher"] is True
    assert get(hub, "/api/organizations/nobody/overview")[0] == 404


@pytest.mark.parametrize("path,code", [
    ("/api/kernels/org/missing/refs", "RepoNotFound"),
    (f"/api/kernels/{REPO}/revision/v7", "RevisionNotFound"),
    (f"/kernels/{REPO}/resolve/v1/build/torch-cuda/nope.py", "EntryNotFound"),
    (f"/kernels/{REPO}/resolve/{'a' * 40}/README.md", "RevisionNotFound"),
])
def test_errors_carry_hub_error_codes(hub, path, code):
    status, headers, _ = get(hub, path)
    assert (status, headers.get("X-Error-Code")) == (404, code)


def test_huggingface_hub_maps_errors_to_its_exceptions(hub):
    api = HfApi(endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_refs("org/missing", repo_type="kernel")
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_files(REPO, repo_type="kernel", revision="v9")
    with pytest.raises(EntryNotFoundError):
        api.hf_hub_download(REPO, "build/nope", repo_type="kernel", revision="v1", cache_dir=str(hub.store.root / "c"))


def test_uploads_through_huggingface_hub(hub):
    api = HfApi(endpoint=hub.endpoint, token="unused")
    api.create_repo("org/new", repo_type="kernel")
    api.create_repo("org/new", repo_type="kernel", exist_ok=True)
    api.create_branch("org/new", repo_type="kernel", branch="v2")
    info = api.create_commit("org/new", repo_type="kernel", revision="v2", commit_message="add",
                             operations=[CommitOperationAdd("build/a.py", b"a"), CommitOperationAdd("b.txt", b"b")])
    assert hub.store.branches("org/new")["v2"] == info.oid
    api.create_commit("org/new", repo_type="kernel", revision="v2", commit_message="del",
                      operations=[CommitOperationDelete("build/")])
    assert sorted(api.list_repo_files("org/new", repo_type="kernel", revision="v2")) == ["b.txt"]
    assert api.list_repo_files("org/new", repo_type="kernel") == []
