"""The ModelScope side of a push, through modelscope_hub's own HubApi: whoami, get_repo, create_repo,
upload_folder (its LFS batch skips blobs the storage already has; no local upload cache is written into the
published folder), create_repo_tag to pin what was uploaded, list_repo_files (size and sha256 of every file) for
the check after the upload.

ModelScope answers a commit with no commit id, so the revision a push produced is a tag named after the
manifest's sha256 (`flux-port-<12 hex>`): the same folder always has the same tag.
whoami names no organisations, so only the token's own namespace is pushed to.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from porting.errors import AuthError, InputError, NetworkError, PortError

from ..fetch.hf_backend import _short
from ..fetch.verify import RemoteFile
from .target import PushTarget, no_token

_LICENSE = re.compile(r"\A---\n(?:.*\n)*?license:\s*([^\s#]+)\s*\n(?:.*\n)*?---\n", re.M)


class MsPusher:
    hub = "modelscope"

    def __init__(self, target: PushTarget) -> None:
        t = str(int(max(1, target.timeout)))  # read by modelscope_hub when it is first imported
        os.environ.update({"MODELSCOPE_API_TIMEOUT": t, "MODELSCOPE_API_CONNECT_TIMEOUT": t})
        import modelscope_hub
        from modelscope_hub import HubApi, get_default_config

        self.target = target
        self.token = get_default_config().token  # MODELSCOPE_API_TOKEN, else the `modelscope login` cookie
        if not self.token:
            raise no_token(target)
        self.api = HubApi(endpoint=target.source.endpoint, token=self.token)
        self.client_version = getattr(modelscope_hub, "__version__", "?")
        self.exists = False
        self.url = target.source.repo_url

    @property
    def secrets(self) -> list[str]:
        return [self.token] if self.token else []

    def preflight(self) -> None:
        from modelscope_hub.errors import NotExistError

        repo, host = self.target.repo, self.target.source.host
        try:
            me = self.api.whoami()
        except Exception as exc:
            raise self.translate(exc, "checking the token") from exc
        owner = repo.split("/")[0]
        if owner != me.username:
            raise AuthError(f"{repo} belongs to {owner!r}, not to the account of this token ({me.username!r} on "
                            f"{host}); nothing was uploaded and no repository was created.",
                            hint=f"Push to {me.username}/{repo.split('/')[1]}, or use a token of {owner!r} "
                                 "(ModelScope's whoami names no organisations, so flux-port pushes only to the "
                                 "token's own namespace).")
        try:
            self.api.get_repo(repo, "model")
            self.exists = True
        except NotExistError:
            self.exists = False
        except Exception as exc:
            raise self.translate(exc, f"looking up {repo}") from exc

    def head(self) -> str:
        return "master"

    def listing(self, revision: str | None = None) -> dict[str, RemoteFile]:
        try:
            entries = self.api.list_repo_files(self.target.repo, "model", revision=revision or "master")
        except Exception as exc:
            raise self.translate(exc, f"listing {self.target.repo}") from exc
        return {e.path: RemoteFile(e.path, int(e.size), e.sha256 or None) for e in entries if not e.is_dir}

    def read(self, path: str, revision: str | None = None) -> bytes:
        try:
            with tempfile.TemporaryDirectory(prefix="flux-port-push-") as tmp:
                got = self.api.download_file(self.target.repo, "model", path, revision=revision or "master",
                                             local_dir=tmp)
                return Path(got).read_bytes()
        except Exception as exc:
            raise self.translate(exc, f"reading {path} of {self.target.repo}") from exc

    def create(self, card: bytes = b"") -> None:
        m = _LICENSE.match(card.decode("utf-8", "replace"))
        try:
            self.api.create_repo(self.target.repo, "model", visibility="private" if self.target.private else "public",
                                 **({"license": m.group(1)} if m else {}))
        except Exception as exc:
            raise self.translate(exc, f"creating {self.target.repo}") from exc

    def commit(self, adds: list[tuple[str, Path | bytes]], deletes: list[str], message: str,
               description: str, digests: dict[str, str] | None = None) -> str:
        """One upload; ModelScope's client hashes the files itself (it takes no digest), so `digests` is unused."""
        repo = self.target.repo
        if not os.environ.get("FLUX_PORT_DEBUG"):
            logging.getLogger("modelscope_hub").setLevel(logging.WARNING)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the client prints its upload report; stdout is ours
                self._commit(repo, adds, deletes, message, description)
        except Exception as exc:
            raise self.translate(exc, f"uploading to {repo}") from exc
        return "master"

    def _commit(self, repo: str, adds: list[tuple[str, Path | bytes]], deletes: list[str], message: str,
                description: str) -> None:
        if deletes:
            self.api.delete_files(repo, "model", deletes, commit_message=message)
        files = [(p, src) for p, src in adds if isinstance(src, Path)]
        if files:
            p0, src0 = files[0]
            folder = Path(str(src0)[: -len(p0)])
            self.api.upload_folder(repo, "model", folder, allow_patterns=[glob.escape(p) for p, _ in files],
                                   commit_message=message, commit_description=description, use_cache=False,
                                   disable_tqdm=True)
        for p, data in adds:
            if isinstance(data, bytes):
                self.api.upload_file(repo, "model", data, p, commit_message=message,
                                     commit_description=description, disable_tqdm=True)

    def pin(self, revision: str, identity: str) -> str:
        """A tag on `revision` named after the folder's identity (an existing one is kept: the check after the
        upload compares what it points at)."""
        tag = f"flux-port-{identity[:12]}"
        try:
            self.api.create_repo_tag(self.target.repo, "model", tag, revision=revision)
        except Exception as exc:
            try:
                self.api.list_repo_files(self.target.repo, "model", revision=tag)
            except Exception:
                raise self.translate(exc, f"tagging {self.target.repo}") from exc
        return tag

    def translate(self, exc: BaseException, doing: str) -> PortError:
        from modelscope_hub import errors as ms

        if isinstance(exc, PortError):
            return exc
        host, repo = self.target.source.host, self.target.repo
        cause: Any = exc.__cause__ if isinstance(exc.__cause__, ms.HubError) else exc
        if isinstance(cause, ms.AuthenticationError):
            return AuthError(f"{host} rejected the token (HTTP 401) while {doing}; nothing was uploaded.",
                             hint="Set MODELSCOPE_API_TOKEN to a valid token (or run `modelscope login` again), "
                                  "then run the same command again.")
        if isinstance(cause, ms.PermissionDeniedError):
            return AuthError(f"{host} refused write access to {repo} (HTTP 403) while {doing}.",
                             hint="Use a ModelScope token of the account that owns the repository.")
        if isinstance(cause, ms.NotExistError):
            return InputError(f"{host} answered 404 while {doing}.",
                              hint="Check the repository id and the endpoint (MODELSCOPE_ENDPOINT / --endpoint).")
        if isinstance(cause, (ms.NetworkError, ms.ServerError, ms.RateLimitError)):
            return NetworkError(f"{host} failed while {doing}: {_short(cause)}",
                                hint="Run the same command again later: it resumes (blobs already stored are not "
                                     "sent again).")
        return PortError(f"{doing.capitalize()} on {host} failed: {_short(exc)}")
