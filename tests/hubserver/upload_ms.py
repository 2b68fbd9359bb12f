"""Upload routes of the fake ModelScope, enough for modelscope_hub 0.5's HubApi (whoami, get_repo, create_repo,
upload_folder / upload_file, create_repo_tag; observed against a logging server): `GET /openapi/v1/users/me`,
`GET /openapi/v1/models/{o}/{n}`, `POST /api/v1/models`, the LFS batch API under `/api/v1/repos/models/{o}/{n}/`,
the blob PUT, `POST /api/v1/repos/models/{o}/{n}/commit/{rev}` (JSON actions) and `POST .../repo/tag`.
A mixin of server.py's request handler, sharing the Hub's accounts, LFS store and test switches."""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit


class MsUploadRoutes:
    owner: Any
    headers: Any
    path: str

    def _ms_token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        if auth.startswith("Bearer "):
            return auth[7:]
        m = re.search(r"m_session_id=([^;]+)", self.headers.get("Cookie") or "")
        return m.group(1) if m else None

    def _ms_user(self) -> tuple[str, list[str]] | None:
        return self.owner.users.get(self._ms_token() or "")

    def _ms_may_write(self, namespace: str) -> bool:
        user = self._ms_user()
        return user is not None and (namespace == user[0] or namespace in user[1])

    def _ms_hidden(self, repo: Any) -> bool:
        return bool(repo.private) and not self._ms_may_write(repo.repo_id.split("/")[0])

    def _ms_read_extra(self, entry: Any) -> bool:
        path = unquote(urlsplit(self.path).path)
        if path == "/openapi/v1/users/me":
            user = self._ms_user()
            if user is None:
                self._json(entry, 401, {"success": False, "code": 10010101, "message": "invalid token"})
            else:
                self._json(entry, 200, {"success": True, "data": {"username": user[0], "id": 1}})
            return True
        m = re.fullmatch(r"/openapi/v1/models/([^/]+/[^/]+)", path)
        if m:
            repo = self.owner.ms.get(m.group(1))
            if repo is None or self._ms_hidden(repo):
                self._json(entry, 404, {"success": False, "message": f"model {m.group(1)} not found"})
            else:
                owner, name = repo.repo_id.split("/")
                self._json(entry, 200, {"success": True, "data": {"owner": owner, "name": name,
                                                                  "private": repo.private}})
            return True
        return False

    def _ms_write(self, entry: Any) -> None:
        path = unquote(urlsplit(self.path).path)
        body = self._read_body(entry)
        if path == "/api/v1/models":
            return self._ms_create(entry, json.loads(body))
        m = re.fullmatch(r"/ms-blob/([0-9a-f]{64})", path)
        if m:
            return self._ms_blob(entry, m.group(1), body)
        m = re.fullmatch(r"/api/v1/(?:repos/)?models/([^/]+/[^/]+)/(info/lfs/objects/batch|commit/[^/]+|repo/tag)",
                         path)
        if not m:
            return self._ms_error(entry, 404, "not found")
        repo = self.owner.ms.get(m.group(1))
        if repo is None or self._ms_hidden(repo):
            return self._ms_error(entry, 404, f"model {m.group(1)} not found")
        if not self._ms_may_write(repo.repo_id.split("/")[0]):
            return self._ms_error(entry, 403 if self._ms_user() else 401, "no write access")
        doc = json.loads(body or b"{}")
        if m.group(2) == "info/lfs/objects/batch":
            objects = [{"oid": o["oid"], "size": o["size"],
                        **({} if o["oid"] in self.owner.lfs_store else
                           {"actions": {"upload": {"href": f"{self.owner.ms_url}/ms-blob/{o['oid']}"}}})}
                       for o in doc.get("objects", [])]
            return self._json(entry, 200, {"Code": 200, "Success": True, "Data": {"objects": objects}})
        if m.group(2) == "repo/tag":
            commit = repo.commit(doc.get("Ref") or "master")
            if commit is None or doc.get("TagName") in repo.branches:
                return self._ms_error(entry, 400, f"cannot create tag {doc.get('TagName')}")
            repo.branches[doc["TagName"]] = commit
            return self._json(entry, 200, {"Code": 200, "Success": True, "Data": {}})
        return self._ms_commit(entry, repo, doc)

    def _ms_create(self, entry: Any, doc: dict[str, Any]) -> None:
        from .server import Repo

        repo_id = f"{doc.get('Path')}/{doc.get('Name')}"
        if self._ms_user() is None:
            return self._ms_error(entry, 401, "authentication required")
        if not self._ms_may_write(str(doc.get("Path"))):
            return self._ms_error(entry, 403, f"no permission to create under {doc.get('Path')}")
        if repo_id in self.owner.ms:
            return self._ms_error(entry, 409, f"model {repo_id} already exists")
        repo = Repo(repo_id, {}, private=doc.get("Visibility") == 1)
        repo.history[repo.branches["master"]] = {}
        self.owner.ms[repo_id] = repo
        self.owner.created.append(f"ms:{repo_id}")
        self._json(entry, 200, {"Code": 200, "Success": True, "Data": {}})

    def _ms_blob(self, entry: Any, oid: str, body: bytes) -> None:
        if self._store_upload(entry, oid, body):
            self._json(entry, 200, {"Code": 200, "Success": True})

    def _ms_commit(self, entry: Any, repo: Any, doc: dict[str, Any]) -> None:
        files = dict(repo.files)
        for action in doc.get("actions", []):
            p = action["path"]
            if action["action"] == "delete":
                files.pop(p, None)
            elif action.get("type") == "lfs":
                data = self.owner.lfs_store.get(action["sha256"])
                if data is None:
                    return self._ms_error(entry, 400, f"LFS object {action['sha256']} was never uploaded")
                files[p] = data
                repo.lfs.add(p)
            else:
                files[p] = base64.b64decode(action["content"])
                repo.lfs.discard(p)
        for p in self.owner.tamper & set(files):
            files[p] = files[p][::-1]
        commit = os.urandom(20).hex()
        repo.files = files
        repo.history[commit] = dict(files)
        repo.branches["master"] = commit
        repo.commits.append(({"summary": doc.get("commit_message", "")}, commit))
        self._json(entry, 200, {"Code": 200, "Success": True, "Data": {}})
