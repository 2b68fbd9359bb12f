"""Local stand-ins for the Hugging Face Hub (hub port + CDN port) and ModelScope, speaking just enough of each
protocol for the real huggingface_hub and modelscope_hub clients (shared/hub-protocols.md, section 4).

stdlib only; thread-per-request servers on 127.0.0.1 with ephemeral ports; every request is logged (method,
path, Range, whether Authorization / Cookie came and with which value, status, body bytes sent).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from .upload import HfUploadRoutes
from .upload_ms import MsUploadRoutes

GOOD_TOKEN = "hf_good_test_token"
OTHER_TOKEN = "hf_other_user_token"   # a valid token of another account (for "belongs to someone else")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Repo:
    """A repository served by a fake hub. LFS = *.safetensors unless `lfs` is given."""

    repo_id: str
    files: dict[str, bytes]
    branches: dict[str, str] = field(default_factory=dict)   # name -> commit (default: main/master -> random)
    gated: bool = False                                      # needs `Bearer GOOD_TOKEN`
    lfs: set[str] | None = None
    extra_listing: list[dict[str, Any]] = field(default_factory=list)  # raw entries appended to listings
    private: bool = False                                    # hidden (404) from all but its namespace's users
    history: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files, for uploaded repos
    commits: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # (commit header, commit id)

    def __post_init__(self) -> None:
        if not self.branches:
            commit = os.urandom(20).hex()
            self.branches = {"main": commit, "master": commit}
        if self.lfs is None:
            self.lfs = {p for p in self.files if p.endswith(".safetensors")}

    def commit(self, rev: str) -> str | None:
        if rev in self.branches:
            return self.branches[rev]
        return rev if rev in self.branches.values() or rev in self.history else None


@dataclass
class Logged:
    server: str
    method: str
    path: str
    range: str | None
    authorization: str | None
    cookie: str | None
    status: int = 0
    sent: int = 0
    received: int = 0


class FakeHubs:
    """Three servers: `hub_url` (HF API + resolve), `cdn_url` (LFS blobs), `ms_url` (ModelScope)."""

    def __init__(self) -> None:
        self.hf: dict[str, Repo] = {}
        self.ms: dict[str, Repo] = {}
        self.log: list[Logged] = []
        self.corrupt: set[str] = set()            # repo paths served with same-size wrong bytes
        self.stall_after: dict[str, int] = {}     # repo path -> send this many body bytes, then hang
        self.stalled = threading.Event()          # set when a stalled response has sent its bytes
        self.release = threading.Event()          # lets stalled handlers finish (set at close)
        self.users = {GOOD_TOKEN: ("alice", ["alice-org"]), OTHER_TOKEN: ("mallory", [])}  # token -> account
        self.lfs_store: dict[str, bytes] = {}     # uploaded LFS objects by sha256 (kept across commits)
        self.created: list[str] = []              # repositories created through the API
        self.tamper: set[str] = set()             # repo paths stored with other bytes (same size) at commit
        self.hold_uploads: set[str] = set()       # LFS oids whose upload hangs (until `release`)
        self.fail_commits: list[str] = []         # commit summaries (prefixes) answered once with HTTP 500
        self._lock = threading.Lock()
        self._silent: list[socket.socket] = []
        self._servers = {name: self._start(name) for name in ("hub", "cdn", "ms")}

    # -- setup ------------------------------------------------------------------------------------------------
    def add_hf(self, repo: Repo) -> Repo:
        self.hf[repo.repo_id] = repo
        return repo

    def add_ms(self, repo: Repo) -> Repo:
        self.ms[repo.repo_id] = repo
        return repo

    def url(self, name: str) -> str:
        host, port = self._servers[name].server_address[:2]
        return f"http://{host}:{port}"

    @property
    def hub_url(self) -> str:
        return self.url("hub")

    @property
    def cdn_url(self) -> str:
        return self.url("cdn")

    @property
    def ms_url(self) -> str:
        return self.url("ms")

    def silent_url(self) -> str:
        """An endpoint that accepts TCP connections (kernel backlog) and never answers."""
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        self._silent.append(s)
        return f"http://127.0.0.1:{s.getsockname()[1]}"

    def requests(self, server: str | None = None, method: str | None = None, contains: str = "") -> list[Logged]:
        with self._lock:
            return [r for r in self.log if (server is None or r.server == server)
                    and (method is None or r.method == method) and contains in r.path]

    def close(self) -> None:
        self.release.set()
        for srv in self._servers.values():
            srv.shutdown()
            srv.server_close()
        for s in self._silent:
            s.close()

    # -- internals --------------------------------------------------------------------------------------------
    def _start(self, name: str) -> ThreadingHTTPServer:
        hubs = self

        class Handler(_Handler):
            server_name_ = name
            owner = hubs

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name=f"fake-{name}").start()
        return srv

    def blob(self, digest: str) -> tuple[Repo, str, bytes] | None:
        for repo in list(self.hf.values()):
            for path, data in repo.files.items():
                if path in repo.lfs and sha256(data) == digest:
                    return repo, path, data
        return None


class _Handler(HfUploadRoutes, MsUploadRoutes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_name_ = ""
    owner: FakeHubs

    def log_message(self, *args: Any) -> None:
        pass

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _entry(self) -> Logged:
        entry = Logged(self.server_name_, self.command, self.path, self.headers.get("Range"),
                       self.headers.get("Authorization"), self.headers.get("Cookie"))
        with self.owner._lock:
            self.owner.log.append(entry)
        return entry

    def _send(self, entry: Logged, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_length: int | None = None) -> None:
        entry.status = status
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            entry.sent += len(body)

    def _json(self, entry: Logged, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        self._send(entry, status, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _hf_error(self, entry: Logged, status: int, code: str, message: str, commit: str | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        self._json(entry, status, {"error": message}, headers)

    def _body(self, entry: Logged, path: str, data: bytes, headers: dict[str, str]) -> None:
        """Serve `data` with Range support, corruption and stall modes."""
        if path in self.owner.corrupt:
            data = data[::-1]
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        status = 200
        if m and int(m.group(1)) < len(data):
            start, status = int(m.group(1)), 206
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        chunk = data[start:]
        stall = self.owner.stall_after.get(path)
        if self.command == "HEAD" or stall is None:
            self._send(entry, status, chunk, headers)
            return
        entry.status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        first = chunk[:stall]
        self.wfile.write(first)
        self.wfile.flush()
        entry.sent += len(first)
        self.owner.stalled.set()
        self.owner.release.wait(120)
        self.close_connection = True

    # -- dispatch ---------------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        entry = self._entry()
        try:
            getattr(self, f"_{self.server_name_}")(entry)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_POST(self) -> None:
        entry = self._entry()
        try:
            getattr(self, f"_{self.server_name_}_write", self._no_write)(entry)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_PUT = do_POST

    def _no_write(self, entry: Logged) -> None:
        self._json(entry, 405, {"error": "method not allowed"})

    # -- Hugging Face hub -------------------------------------------------------------------------------------
    def _auth_hf(self, entry: Logged, repo: Repo) -> bool:
        if not repo.gated:
            return True
        auth = self.headers.get("Authorization")
        if auth is None:
            self._hf_error(entry, 401, "GatedRepo", f"Access to model {repo.repo_id} is restricted. You must have "
                           "access to it and be authenticated to access it. Please log in.")
            return False
        if auth != f"Bearer {GOOD_TOKEN}":
            self._hf_error(entry, 403, "GatedRepo", f"Access to model {repo.repo_id} is restricted and you are "
                           f"not in the authorized list. Visit https://huggingface.co/{repo.repo_id} to ask for "
                           "access.")
            return False
        return True

    def _hf_repo_at(self, entry: Logged, repo_id: str, revision: str) -> tuple[Any, str] | None:
        """The repo and the commit `revision` resolves to, or None after answering 404/401/403."""
        repo = self.owner.hf.get(repo_id)
        if repo is None or self._hidden(repo):
            self._hf_error(entry, 404, "RepoNotFound", "Repository not found")
            return None
        if not self._auth_hf(entry, repo):
            return None
        commit = repo.commit(revision)
        if commit is None:
            self._hf_error(entry, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _hub(self, entry: Logged) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        if self._hub_read_extra(entry, path):
            return None
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
        if m:
            found = self._hf_repo_at(entry, m.group(1), m.group(3))
            if found is None:
                return None
            repo, commit = found
            if m.group(2) == "revision":
                return self._json(entry, 200, {"id": repo.repo_id, "sha": commit,
                                               "siblings": [{"rfilename": p} for p in repo.files]})
            tree = []
            for p, data in repo.history.get(commit, repo.files).items():
                item: dict[str, Any] = {"type": "file", "path": p, "size": len(data), "oid": git_sha1(data)}
                if p in repo.lfs:
                    item["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
                tree.append(item)
            return self._json(entry, 200, tree + repo.extra_listing)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            found = self._hf_repo_at(entry, m.group(1), m.group(2))
            if found is None:
                return None
            repo, commit = found
            fpath = m.group(3)
            if fpath not in repo.files:
                return self._hf_error(entry, 404, "EntryNotFound", f"{fpath} does not exist", commit)
            data = repo.files[fpath]
            if fpath in repo.lfs:
                digest = sha256(data)
                return self._send(entry, 302, b"", {
                    "Location": f"{self.owner.cdn_url}/blobs/{digest}?name={quote(fpath)}", "X-Repo-Commit": commit,
                    "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data)), "ETag": f'"{git_sha1(data)}"'})
            return self._body(entry, fpath, data, {"X-Repo-Commit": commit, "ETag": f'"{git_sha1(data)}"'})
        return self._json(entry, 404, {"error": "not found"})

    def _cdn(self, entry: Logged) -> None:
        m = re.fullmatch(r"/blobs/([0-9a-f]{64})", urlsplit(self.path).path)
        found = self.owner.blob(m.group(1)) if m else None
        if found is None:
            return self._send(entry, 404, b"no such blob")
        _, fpath, data = found
        self._body(entry, fpath, data, {"Content-Type": "application/octet-stream"})

    # -- ModelScope -------------------------------------------------------------------------------------------
    def _ms_error(self, entry: Logged, status: int, message: str) -> None:
        self._json(entry, status, {"Code": status, "Success": False, "Message": message})

    def _auth_ms(self, entry: Logged, repo: Repo) -> bool:
        if not repo.gated:
            return True
        auth = self.headers.get("Authorization")
        cookie = self.headers.get("Cookie") or ""
        token = auth[7:] if auth and auth.startswith("Bearer ") else None
        m = re.search(r"m_session_id=([^;]+)", cookie)
        token = token or (m.group(1) if m else None)
        if token is None:
            self._ms_error(entry, 401, "authentication required")
            return False
        if token != GOOD_TOKEN:
            self._ms_error(entry, 403, "permission denied")
            return False
        return True

    def _ms(self, entry: Logged) -> None:
        url = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if self._ms_read_extra(entry):
            return None
        m = re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/(repo/files|repo|revisions)", unquote(url.path))
        if not m:
            return self._ms_error(entry, 404, "not found")
        repo = self.owner.ms.get(m.group(1))
        if repo is None or self._ms_hidden(repo):
            return self._ms_error(entry, 404, f"model {m.group(1)} not found")
        if not self._auth_ms(entry, repo):
            return None
        if m.group(2) == "revisions":
            return self._json(entry, 200, {"Code": 200, "Data": {"RevisionMap": {
                "Branches": [{"Revision": b, "CreatedAt": 1700000000} for b in repo.branches], "Tags": []}}})
        rev = q.get("Revision", "master")
        commit = repo.commit(rev)
        if commit is None:
            return self._ms_error(entry, 404, f"revision {rev} not found")
        if m.group(2) == "repo/files":
            files = [{"Path": p, "Name": p.rsplit("/", 1)[-1], "Type": "blob", "Size": len(d), "Sha256": sha256(d),
                      "IsLFS": p in repo.lfs, "Revision": commit}
                     for p, d in repo.history.get(commit, repo.files).items()]
            return self._json(entry, 200, {"Code": 200, "Success": True,
                                           "Data": {"Files": files + repo.extra_listing}})
        fpath = q.get("FilePath", "")
        files = repo.history.get(commit, repo.files)
        if fpath not in files:
            return self._ms_error(entry, 404, f"file {fpath} not found")
        self._body(entry, fpath, files[fpath], {"Content-Type": "application/octet-stream"})


def tiny_pipeline_files(weights: int = 300_000) -> dict[str, bytes]:
    """A small diffusers-layout repo: JSON configs, a tokenizer file, LFS weights, and BFL's single file."""
    return {
        "model_index.json": b'{"_class_name": "Flux2KleinPipeline"}\n',
        "README.md": b"# tiny test repo\n",
        "scheduler/scheduler_config.json": b'{"shift": 3.0}\n',
        "text_encoder/config.json": b'{"hidden_size": 16}\n',
        "text_encoder/model.safetensors": os.urandom(weights // 3),
        "tokenizer/tokenizer.json": b'{"model": {}}\n',
        "transformer/config.json": b'{"num_layers": 1}\n',
        "transformer/diffusion_pytorch_model.safetensors": os.urandom(weights),
        "vae/config.json": b'{"latent_channels": 4}\n',
        "vae/diffusion_pytorch_model.safetensors": os.urandom(weights // 6),
        "flux-2-klein-tiny.safetensors": os.urandom(weights),
    }
