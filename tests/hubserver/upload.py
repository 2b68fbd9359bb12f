"""Upload routes of the fake Hugging Face Hub, enough for huggingface_hub 2.4's create_repo / create_commit
(shared/hub-protocols.md, section 9): whoami, repo creation and info, preupload, the LFS batch API with basic
transfers, and the ndjson commit. A mixin of server.py's request handler; the state lives on `FakeHubs`.

Test switches on `FakeHubs`: `tamper` (repo paths stored reversed at commit: same size, other bytes),
`hold_uploads` (LFS oids whose PUT is read and then left hanging until `release`, for kill-and-resume tests),
`fail_commits` (commit summaries, by prefix, answered once with HTTP 500).
Xet is refused (501 on the write-token route), as a server without a CAS does.
"""

from __future__ import annotations

import base64
import json
import os
import re
from fnmatch import fnmatch
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.png", "*.jpg")
LFS_MIN = 10 << 20


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    """The Hub's rule: 10 MiB or more, a default .gitattributes pattern, or a NUL byte in the sample."""
    name = path.rsplit("/", 1)[-1]
    return size >= LFS_MIN or any(fnmatch(name, p) for p in LFS_PATTERNS) or b"\0" in sample


class HfUploadRoutes:
    """Mixed into the request handler of server.py (it provides `_entry`, `_json`, `_hf_error`, `owner`...)."""

    owner: Any
    headers: Any
    rfile: Any
    path: str
    command: str

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _read_body(self, entry: Any) -> bytes:
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            body = b"".join(parts)
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        entry.received += len(body)
        return body

    def _user(self) -> tuple[str, list[str]] | None:
        auth = self.headers.get("Authorization") or ""
        return self.owner.users.get(auth[7:]) if auth.startswith("Bearer ") else None

    def _may_write(self, namespace: str) -> bool:
        user = self._user()
        return user is not None and (namespace == user[0] or namespace in user[1])

    # -- GET routes (called first by server.py's `_hub`) ------------------------------------------------------
    def _hub_read_extra(self, entry: Any, path: str) -> bool:
        """whoami, repo info without a revision, the Xet write token; False when `path` is none of them."""
        if path == "/api/whoami-v2":
            user = self._user()
            if user is None:
                self._hf_error(entry, 401, "Unauthorized", "Invalid credentials in Authorization header")
            else:
                self._json(entry, 200, {"type": "user", "name": user[0], "orgs": [{"name": o} for o in user[1]],
                                        "auth": {"type": "access_token"}})
            return True
        if re.fullmatch(r"/api/models/[^/]+/[^/]+/xet-write-token/[^/]+", path):
            self._json(entry, 501, {"error": "Xet storage is not available on this server"})
            return True
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)", path)
        if m:
            found = self._hf_repo_at(entry, m.group(1), "main")
            if found is not None:
                repo, commit = found
                self._json(entry, 200, {"id": repo.repo_id, "sha": commit, "private": repo.private,
                                        "siblings": [{"rfilename": p} for p in repo.files]})
            return True
        return False

    def _hidden(self, repo: Any) -> bool:
        """A private repository is invisible (404) to anyone but its namespace."""
        return bool(repo.private) and not self._may_write(repo.repo_id.split("/")[0])

    # -- POST / PUT -------------------------------------------------------------------------------------------
    def _hub_write(self, entry: Any) -> None:
        path = unquote(urlsplit(self.path).path)
        body = self._read_body(entry)
        if path == "/api/repos/create":
            return self._create(entry, json.loads(body or b"{}"))
        if path == "/api/validate-yaml":
            return self._json(entry, 200, {"errors": [], "warnings": []})
        m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
        if m:
            return self._lfs_put(entry, m.group(1), body)
        if re.fullmatch(r"/lfs-verify/([0-9a-f]{64})", path):
            return self._json(entry, 200, {})
        m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if m:
            return self._lfs_batch(entry, m.group(1), json.loads(body))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
        if m:
            repo = self.owner.hf.get(m.group(1))
            if repo is None or self._hidden(repo):
                return self._hf_error(entry, 404, "RepoNotFound", "Repository not found")
            if not self._may_write(repo.repo_id.split("/")[0]):
                return self._hf_error(entry, 403, "Forbidden", "You don't have the rights to write to this repo")
            if m.group(2) == "preupload":
                return self._preupload(entry, repo, m.group(3), json.loads(body))
            return self._commit(entry, repo, m.group(3), body)
        return self._json(entry, 404, {"error": "not found"})

    def _create(self, entry: Any, doc: dict[str, Any]) -> None:
        from .server import Repo

        user = self._user()
        if user is None:
            return self._hf_error(entry, 401, "Unauthorized", "Invalid credentials in Authorization header")
        namespace = doc.get("organization") or user[0]
        repo_id = f"{namespace}/{doc['name']}"
        url = f"{self.owner.hub_url}/{repo_id}"
        if repo_id in self.owner.hf and not self._hidden(self.owner.hf[repo_id]):
            return self._json(entry, 409, {"error": "You already created this model repo", "url": url})
        if not self._may_write(namespace):
            return self._hf_error(entry, 403, "Forbidden", f"You don't have the rights to create a model under the "
                                  f"namespace {namespace}")
        if repo_id in self.owner.hf:  # someone else's private repository of that name
            return self._json(entry, 409, {"error": "Repository already exists", "url": url})
        private = doc.get("visibility", "private" if doc.get("private") else "public") == "private"
        repo = Repo(repo_id, {}, private=private)
        repo.history[repo.branches["main"]] = {}
        self.owner.hf[repo_id] = repo
        self.owner.created.append(repo_id)
        self._json(entry, 200, {"url": url, "name": repo_id})

    def _preupload(self, entry: Any, repo: Any, revision: str, doc: dict[str, Any]) -> None:
        from .server import git_sha1, sha256

        files = []
        for f in doc.get("files", []):
            sample = base64.b64decode(f.get("sample") or "")
            lfs = _is_lfs(f["path"], int(f["size"]), sample)
            have = repo.files.get(f["path"])
            oid = None if have is None else (sha256(have) if f["path"] in repo.lfs else git_sha1(have))
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        self._json(entry, 200, {"files": files, "commitOid": repo.branches["main"]})

    def _lfs_batch(self, entry: Any, repo_id: str, doc: dict[str, Any]) -> None:
        if repo_id not in self.owner.hf or not self._may_write(repo_id.split("/")[0]):
            return self._hf_error(entry, 403, "Forbidden", "no write access")
        objects = []
        for obj in doc.get("objects", []):
            oid, size = obj["oid"], obj["size"]
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.owner.lfs_store:  # stored objects come back without actions: not sent again
                item["actions"] = {"upload": {"href": f"{self.owner.hub_url}/lfs-upload/{oid}"},
                                   "verify": {"href": f"{self.owner.hub_url}/lfs-verify/{oid}"}}
            objects.append(item)
        self._send(entry, 200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, entry: Any, oid: str, body: bytes) -> None:
        if self._store_upload(entry, oid, body):
            self._send(entry, 200)

    def _store_upload(self, entry: Any, oid: str, body: bytes) -> bool:
        """Keep an uploaded object (both hubs); False after hanging (`hold_uploads`) or answering 400."""
        from .server import sha256

        if oid in self.owner.hold_uploads:
            self.owner.stalled.set()
            self.owner.release.wait(120)
            self.close_connection = True
            return False
        if sha256(body) != oid:
            self._json(entry, 400, {"error": f"body does not hash to {oid}", "Code": 400, "Success": False})
            return False
        self.owner.lfs_store[oid] = body
        return True

    def _commit(self, entry: Any, repo: Any, revision: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        summary = lines[0]["value"].get("summary", "") if lines and lines[0]["key"] == "header" else ""
        for prefix in list(self.owner.fail_commits):
            if summary.startswith(prefix):  # once: a hub failing that commit
                self.owner.fail_commits.remove(prefix)
                return self._json(entry, 500, {"error": "Internal Error - We're working hard to fix this"})
        files = dict(repo.files)
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                repo.lfs.discard(value["path"])
            elif key == "lfsFile":
                data = self.owner.lfs_store.get(value["oid"])
                if data is None:
                    return self._json(entry, 422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = data
                repo.lfs.add(value["path"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
        for path in self.owner.tamper & set(files):
            files[path] = files[path][::-1]
        commit = os.urandom(20).hex()
        repo.files = files
        repo.history[commit] = dict(files)
        repo.branches["main"] = commit
        repo.commits.append((lines[0]["value"] if lines and lines[0]["key"] == "header" else {}, commit))
        self._json(entry, 200, {"commitOid": commit, "commitUrl": f"{self.owner.hub_url}/{repo.repo_id}/commit/"
                                                                  f"{commit}", "pullRequestUrl": None})
