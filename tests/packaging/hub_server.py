"""A local, Hub-compatible HTTP server for kernel repositories (test fixture only).

It serves the routes that `kernels` 0.17.2 and huggingface_hub 2.4 use to resolve, download, lock and upload a
kernel repo (``repo_type="kernel"``), from a directory laid out like the Hub::

    <root>/orgs.json                          {"<org>": {"trustedKernelPublisher": true|false}}
    <root>/<org>/<name>/refs/<branch>         the branch's commit hash (e.g. refs/main, refs/v1)
    <root>/<org>/<name>/commits/<hash>/...    every file of that commit
    <root>/<org>/<name>/commits/<hash>.json   {"parent": <hash>|null, "message": ...}

Blob oids are git blob sha1s, commit hashes are sha1s over (tree, parent, message), so the same content gives the
same hashes. Unknown repos, revisions and files answer 404 with ``X-Error-Code`` RepoNotFound / RevisionNotFound /
EntryNotFound, as the Hub does. Every request is recorded in ``LocalHub.requests`` so tests can prove that an
offline load made none.

Use it in-process (``with LocalHub(root) as hub: hub.endpoint``) or as a process:
``python tests/packaging/hub_server.py --root DIR [--trusted ORG] [--untrusted ORG]`` prints the endpoint URL and serves
until killed. Standard library only; binds 127.0.0.1 on a random port.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, extra: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra or {}


class HubStore:
    """The on-disk repos. All methods take full repo ids ("org/name")."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()

    # -- organizations ------------------------------------------------------------------------------------------
    def _orgs(self) -> dict:
        path = self.root / "orgs.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def set_trust(self, org: str, trusted: bool) -> None:
        with self._lock:
            orgs = self._orgs()
            orgs[org] = {"trustedKernelPublisher": trusted}
            (self.root / "orgs.json").write_text(json.dumps(orgs, indent=2) + "\n")

    def org(self, org: str) -> dict | None:
        return self._orgs().get(org)

    # -- repos and revisions ------------------------------------------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        org, _, name = repo_id.partition("/")
        if not org or not name or "/" in name or org.startswith("."):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id!r} not found")
        return self.root / org / name

    def exists(self, repo_id: str) -> bool:
        try:
            return (self.repo_dir(repo_id) / "refs").is_dir()
        except HubError:
            return False

    def _require(self, repo_id: str) -> Path:
        if not self.exists(repo_id):
            raise HubError(404, "RepoNotFound", f"Repository {repo_id!r} not found")
        return self.repo_dir(repo_id)

    def create_repo(self, repo_id: str) -> None:
        """A new repo with an empty initial commit on main (like the Hub, which adds .gitattributes)."""
        with self._lock:
            if self.exists(repo_id):
                raise HubError(409, None, f"You already created this kernel repo: {repo_id}")
            (self.repo_dir(repo_id) / "refs").mkdir(parents=True)
            self._write_commit(repo_id, "main", {}, None, "initial commit")
            org = repo_id.split("/")[0]
            if self.org(org) is None:
                self.set_trust(org, False)

    def branches(self, repo_id: str) -> dict[str, str]:
        refs = self._require(repo_id) / "refs"
        return {p.name: p.read_text().strip() for p in sorted(refs.iterdir()) if p.is_file()}

    def resolve(self, repo_id: str, revision: str) -> str:
        """Branch name or full commit hash → commit hash; RevisionNotFound otherwise."""
        repo = self._require(repo_id)
        branches = self.branches(repo_id)
        if revision in branches:
            return branches[revision]
        if _COMMIT.match(revision) and (repo / "commits" / revision).is_dir():
            return revision
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def create_branch(self, repo_id: str, branch: str, start: str | None = None) -> str:
        with self._lock:
            if branch in self.branches(repo_id):
                raise HubError(409, None, f"Reference refs/heads/{branch} already exists")
            if "/" in branch or branch.startswith(".") or not branch:
                raise HubError(400, None, f"Invalid branch name {branch!r}")
            commit = self.resolve(repo_id, start or "main")
            (self.repo_dir(repo_id) / "refs" / branch).write_text(commit + "\n")
            return commit

    def files(self, repo_id: str, commit: str) -> dict[str, Path]:
        base = self._require(repo_id) / "commits" / commit
        return {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}

    def commit(self, repo_id: str, branch: str, add: dict[str, bytes], delete: tuple[str, ...] = (),
               message: str = "update", parent: str | None = None) -> str:
        """Apply additions and deletions (a path or a folder) to `branch` and return the new commit."""
        with self._lock:
            head = self.resolve(repo_id, branch)
            if branch not in self.branches(repo_id):
                raise HubError(400, None, f"Can only commit to a branch, got {branch!r}")
            if parent is not None and not head.startswith(parent):
                raise HubError(412, None, f"Parent commit {parent} is not the head of {branch} ({head})")
            tree = {rel: p.read_bytes() for rel, p in self.files(repo_id, head).items()}
            for path in delete:
                path = path.rstrip("/")
                gone = [rel for rel in tree if rel == path or rel.startswith(path + "/")]
                if not gone:
                    raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {path}")
                for rel in gone:
                    del tree[rel]
            for rel, data in add.items():
                if rel.startswith("/") or ".." in rel.split("/"):
                    raise HubError(400, None, f"Invalid path {rel!r}")
                tree[rel] = data
            return self._write_commit(repo_id, branch, tree, head, message)

    def _write_commit(self, repo_id: str, branch: str, tree: dict[str, bytes], parent: str | None,
                      message: str) -> str:
        tree_hash = hashlib.sha1()
        for rel in sorted(tree):
            tree_hash.update(f"{rel}\0{git_blob_sha1(tree[rel])}\n".encode())
        commit = hashlib.sha1(f"tree {tree_hash.hexdigest()}\nparent {parent}\n\n{message}".encode()).hexdigest()
        repo = self.repo_dir(repo_id)
        target = repo / "commits" / commit
        if not target.exists():
            staging = repo / "commits" / f".{commit}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            for rel, data in tree.items():
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).write_bytes(data)
            staging.mkdir(parents=True, exist_ok=True)
            staging.rename(target)
            (repo / "commits" / f"{commit}.json").write_text(json.dumps({"parent": parent, "message": message}))
        (repo / "refs" / branch).write_text(commit + "\n")
        return commit

    def seed_build(self, repo_id: str, build_dir: Path, readme: bytes, branch: str = "v1") -> str:
        """Lay out a kernel repo as publish.py does: README on main, README + build/ on `branch`."""
        with self._lock:
            if not self.exists(repo_id):
                self.create_repo(repo_id)
            self.commit(repo_id, "main", {"README.md": readme}, message="card")
            if branch not in self.branches(repo_id):
                self.create_branch(repo_id, branch)
            files = {f"build/{p.relative_to(build_dir).as_posix()}": p.read_bytes()
                     for p in sorted(Path(build_dir).rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
            return self.commit(repo_id, branch, files, message="build")

    # -- tree listings ------------------------------------------------------------------------------------------
    def tree(self, repo_id: str, commit: str, path: str, recursive: bool) -> list[dict]:
        files = self.files(repo_id, commit)
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(rel.startswith(prefix) for rel in files):
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {commit}")
        dirs: dict = {}
        entries = []
        for rel, p in files.items():
            if not rel.startswith(prefix):
                continue
            rest = rel[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                d = prefix + "/".join(rest[:depth])
                if recursive or depth == 1:
                    dirs.setdefault(d, hashlib.sha1()).update(rel.encode())
            if recursive or len(rest) == 1:
                data = p.read_bytes()
                entries.append({"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": rel})
        entries += [{"type": "directory", "oid": h.hexdigest(), "size": 0, "path": d} for d, h in dirs.items()]
        return sorted(entries, key=lambda e: e["path"])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args):  # quiet; LocalHub.requests keeps the record
        pass

    # -- plumbing -----------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload) -> None:
        self._send(status, json.dumps(payload).encode())

    def _error(self, err: HubError, head: bool = False) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, json.dumps({"error": err.message, **err.extra}).encode(), headers, head=head)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.server.hub.requests.append((method, url.path))
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        try:
            self._route(method, parts, query)
        except HubError as err:
            self._error(err, head=method == "HEAD")
        except (ValueError, KeyError) as err:
            self._error(HubError(400, None, f"Bad request: {err}"), head=method == "HEAD")

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    # -- routes ---------------------------------------------------------------------------------------------------
    def _route(self, method: str, p: list[str], query: dict[str, str]) -> None:
        store = self.server.hub.store
        if method == "POST":
            self._check_token()
            return self._route_post(p)
        if p[:2] == ["api", "organizations"] and len(p) == 4 and p[3] == "overview":
            org = store.org(p[2])
            if org is None:
                raise HubError(404, None, f"Organization {p[2]!r} not found")
            return self._json(200, {"name": p[2], "fullname": p[2], "avatarUrl": "", **org})
        if p[:2] == ["api", "kernels"] and len(p) >= 4:
            repo_id = f"{p[2]}/{p[3]}"
            rest = p[4:]
            if not rest:
                return self._json(200, self._repo_info(repo_id, store.resolve(repo_id, "main")))
            if rest == ["refs"]:
                branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c}
                            for b, c in store.branches(repo_id).items()]
                return self._json(200, {"branches": branches, "converts": [], "tags": []})
            if rest[0] == "revision" and len(rest) >= 2:
                return self._json(200, self._repo_info(repo_id, store.resolve(repo_id, "/".join(rest[1:]))))
            if rest[0] == "tree" and len(rest) >= 2:
                commit = store.resolve(repo_id, rest[1])
                recursive = query.get("recursive", "false").lower() in ("1", "true")
                return self._json(200, store.tree(repo_id, commit, "/".join(rest[2:]), recursive))
        if p[0] == "kernels" and len(p) >= 6 and p[3] == "resolve":
            return self._resolve(f"{p[1]}/{p[2]}", p[4], "/".join(p[5:]), head=method == "HEAD")
        if p[:2] == ["api", "models"] or p[:2] == ["api", "datasets"] or p[:2] == ["api", "spaces"]:
            raise HubError(404, "RepoNotFound", "This local hub only serves kernel repositories")
        raise HubError(404, None, f"Not found: {self.path}")

    def _repo_info(self, repo_id: str, commit: str) -> dict:
        siblings = [{"rfilename": rel} for rel in self.server.hub.store.files(repo_id, commit)]
        return {"id": repo_id, "author": repo_id.split("/")[0], "sha": commit, "private": False,
                "siblings": siblings}

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        store = self.server.hub.store
        commit = store.resolve(repo_id, revision)
        file = store.files(repo_id, commit).get(path)
        if file is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        data = file.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(data)}"', "Accept-Ranges": "none"}
        self._send(200, data, headers, content_type="application/octet-stream", head=head)

    def _check_token(self) -> None:
        token = self.server.hub.write_token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            raise HubError(401, None, "Invalid credentials in Authorization header")

    def _route_post(self, p: list[str]) -> None:
        store = self.server.hub.store
        body = self._body()
        if p == ["api", "validate-yaml"]:
            return self._json(200, {"errors": [], "warnings": []})
        if p == ["api", "repos", "create"]:
            payload = json.loads(body or b"{}")
            if payload.get("type") != "kernel":
                raise HubError(400, None, f"This local hub only creates kernel repos, got type {payload.get('type')!r}")
            repo_id = f"{payload['organization']}/{payload['name']}"
            url = f"{self.server.hub.endpoint}/kernels/{repo_id}"
            try:
                store.create_repo(repo_id)
            except HubError as err:  # the Hub's 409 names the existing repo, and huggingface_hub reads it
                err.extra["url"] = url
                raise
            return self._json(200, {"url": url, "name": repo_id})
        if p[:2] == ["api", "kernels"] and len(p) >= 6:
            repo_id, action, revision = f"{p[2]}/{p[3]}", p[4], "/".join(p[5:])
            if action == "branch":
                start = json.loads(body or b"{}").get("startingPoint")
                store.create_branch(repo_id, revision, start)
                return self._json(200, {})
            if action == "preupload":
                return self._preupload(repo_id, revision, json.loads(body))
            if action == "commit":
                return self._commit(repo_id, revision, body)
        raise HubError(404, None, f"Not found: POST {self.path}")

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> None:
        store = self.server.hub.store
        existing = store.files(repo_id, store.resolve(repo_id, revision))
        files = []
        for f in payload["files"]:
            oid = git_blob_sha1(existing[f["path"]].read_bytes()) if f["path"] in existing else None
            files.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": store.resolve(repo_id, revision)})

    def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
        add: dict[str, bytes] = {}
        delete: list[str] = []
        header: dict = {}
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, None, f"Unsupported encoding {value.get('encoding')!r}")
                add[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                delete.append(value["path"])
            else:
                raise HubError(400, None, f"The local hub does not support commit operation {key!r} (LFS/copy)")
        message = header.get("summary", "update")
        if header.get("description"):
            message += "\n\n" + header["description"]
        commit = self.server.hub.store.commit(repo_id, revision, add, tuple(delete), message,
                                              parent=header.get("parentCommit"))
        self._json(200, {"commitUrl": f"{self.server.hub.endpoint}/kernels/{repo_id}/commit/{commit}",
                         "commitOid": commit, "pullRequestUrl": None})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: "LocalHub"


class LocalHub:
    """Serve a HubStore on 127.0.0.1 (random port) from a background thread; a context manager."""

    def __init__(self, root: Path, write_token: str | None = None):
        self.store = HubStore(root)
        self.write_token = write_token
        self.requests: list[tuple[str, str]] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("LocalHub is not running; call start() or use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "LocalHub":
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="local-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve kernel repos from a directory over a Hub-compatible API.")
    parser.add_argument("--root", type=Path, required=True, help="directory laid out as in this module's docstring")
    parser.add_argument("--trusted", action="append", default=[], help="org whose overview says trusted (repeat)")
    parser.add_argument("--untrusted", action="append", default=[], help="org whose overview says untrusted")
    parser.add_argument("--write-token", default=None, help="require 'Authorization: Bearer TOKEN' on POST")
    parser.add_argument("--seed", action="append", default=[], metavar="ORG/NAME=BUILD_DIR",
                        help="before serving, publish BUILD_DIR (a build/ directory) to branch v1 of ORG/NAME")
    args = parser.parse_args(argv)
    hub = LocalHub(args.root, write_token=args.write_token)
    for org in args.trusted:
        hub.store.set_trust(org, True)
    for org in args.untrusted:
        hub.store.set_trust(org, False)
    for seed in args.seed:
        repo_id, sep, build_dir = seed.partition("=")
        if not sep or not (Path(build_dir) / "torch-cuda" / "metadata.json").is_file():
            parser.error(f"--seed {seed!r}: expected ORG/NAME=BUILD_DIR with BUILD_DIR/torch-cuda/metadata.json")
        hub.store.seed_build(repo_id, Path(build_dir), b"---\nlibrary_name: kernels\n---\n\nSeeded test repo.\n")
    hub.start()
    print(hub.endpoint, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
