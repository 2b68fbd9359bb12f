"""The Hugging Face Hub side of a push, through huggingface_hub's own HfApi: whoami, repo_info, create_repo,
create_commit (one commit; the client's preupload skips files the repo already holds and its LFS batch skips
objects the storage already has), list_repo_tree for the check after the upload.

With `hf_xet` installed and HF_HUB_DISABLE_XET unset the client uploads through Xet and has no fallback: an
endpoint without Xet storage fails that upload, which is refused here with the setting that avoids it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from porting.errors import AuthError, InputError, NetworkError, PortError

from ..fetch.hf_backend import _bound_all_requests, _short
from ..fetch.verify import RemoteFile
from .target import PushTarget, no_token


class HfPusher:
    hub = "hf"

    def __init__(self, target: PushTarget) -> None:
        import huggingface_hub
        from huggingface_hub import HfApi

        self.target = target
        _bound_all_requests(target.timeout)  # some client calls (whoami, the tree listing) would wait forever
        self.token = huggingface_hub.get_token()  # HF_TOKEN, else the stored `hf auth login`
        if not self.token:
            raise no_token(target)
        self.api = HfApi(endpoint=target.source.endpoint, token=self.token)
        self.client_version = huggingface_hub.__version__
        self.exists = False
        self.url = f"{target.source.endpoint}/{target.repo}"

    @property
    def secrets(self) -> list[str]:
        return [self.token] if self.token else []

    @property
    def xet(self) -> bool:
        from huggingface_hub.utils import is_xet_available

        return bool(is_xet_available())

    def preflight(self) -> None:
        """The token is accepted, the namespace is the token's account or one of its organisations, and whether
        the repository exists. Reads only."""
        repo, host = self.target.repo, self.target.source.host
        try:
            me = self.api.whoami(token=self.token)
        except Exception as exc:
            raise self.translate(exc, "checking the token") from exc
        spaces = {me.get("name")} | {o.get("name") for o in me.get("orgs") or [] if isinstance(o, dict)}
        owner = repo.split("/")[0]
        if owner not in spaces:
            raise AuthError(f"{repo} belongs to {owner!r}, which is neither the account of this token "
                            f"({me.get('name')!r} on {host}) nor one of its organisations; nothing was uploaded "
                            "and no repository was created.",
                            hint=f"Push to a repository under {me.get('name')}/ (or an organisation you belong "
                                 "to), or use a token of the account that owns it.")
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            self.api.repo_info(repo)
            self.exists = True
        except RepositoryNotFoundError:
            self.exists = False
        except Exception as exc:
            raise self.translate(exc, f"looking up {repo}") from exc

    def head(self) -> str:
        try:
            return str(self.api.repo_info(self.target.repo).sha)
        except Exception as exc:
            raise self.translate(exc, f"reading the revision of {self.target.repo}") from exc

    def listing(self, revision: str | None = None) -> dict[str, RemoteFile]:
        from huggingface_hub.hf_api import RepoFile

        try:
            entries = self.api.list_repo_tree(self.target.repo, recursive=True, revision=revision)
            return {e.path: RemoteFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else None,
                                       None if e.lfs else e.blob_id)
                    for e in entries if isinstance(e, RepoFile)}
        except Exception as exc:
            raise self.translate(exc, f"listing {self.target.repo}") from exc

    def read(self, path: str, revision: str | None = None) -> bytes:
        try:
            with tempfile.TemporaryDirectory(prefix="flux-port-push-") as tmp:
                got = self.api.hf_hub_download(self.target.repo, path, revision=revision, local_dir=tmp)
                return Path(got).read_bytes()
        except Exception as exc:
            raise self.translate(exc, f"reading {path} of {self.target.repo}") from exc

    def create(self, card: bytes = b"") -> None:
        try:
            self.api.create_repo(self.target.repo, private=self.target.private, exist_ok=True)
        except Exception as exc:
            raise self.translate(exc, f"creating {self.target.repo}") from exc

    def commit(self, adds: list[tuple[str, Path | bytes]], deletes: list[str], message: str,
               description: str, digests: dict[str, str] | None = None) -> str:
        """One commit; returns its revision. `digests`: the sha256 of files already known (the LFS oid), which
        huggingface_hub would otherwise read each file once more to compute."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in deletes]
        for p, src in adds:
            op = CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(src) if isinstance(src, Path) else src)
            if digests and p in digests:
                op.upload_info.sha256 = bytes.fromhex(digests[p])
            ops.append(op)
        try:
            info = self.api.create_commit(self.target.repo, ops, commit_message=message,
                                          commit_description=description)
        except Exception as exc:
            raise self.translate(exc, f"uploading to {self.target.repo}") from exc
        return str(info.oid)

    def pin(self, revision: str, identity: str) -> str:
        """A Hub commit id already pins its files."""
        return revision

    def translate(self, exc: BaseException, doing: str) -> PortError:
        """huggingface_hub / httpx2 errors as flux-port errors (exit 2, 3, 4); never quoting a token."""
        import httpx2
        from huggingface_hub import errors as hf

        if isinstance(exc, PortError):
            return exc
        host, repo = self.target.source.host, self.target.repo
        if isinstance(exc, hf.LocalTokenNotFoundError):
            return no_token(self.target)
        if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None:
            status = exc.response.status_code
            if status == 401:
                return AuthError(f"{host} rejected the token (HTTP 401) while {doing}; nothing was uploaded.",
                                 hint="Set HF_TOKEN to a valid token with write access (or run `hf auth login` "
                                      "again), then run the same command again.")
            if status == 403:
                return AuthError(f"{host} refused write access to {repo} (HTTP 403) while {doing}.",
                                 hint="Use a token with write access to that namespace (a fine-grained token "
                                      "needs 'write' on the repository or organisation).")
            if status == 404:
                return InputError(f"{host} answered 404 while {doing}.",
                                  hint="Check the repository id and the endpoint (HF_ENDPOINT / --endpoint).")
            if status == 429 or status >= 500:
                return NetworkError(f"{host} answered HTTP {status} while {doing}.",
                                    hint="The server is busy or failing; run the same command again later: it "
                                         "resumes (files already stored are not sent again).")
        if "xet" in str(exc).lower():
            return PortError(f"{host} refused huggingface_hub's Xet upload path while {doing}: {_short(exc)}. "
                             "Nothing was committed.",
                             hint="This endpoint has no Xet storage: set HF_HUB_DISABLE_XET=1 to upload with plain "
                                  "Git LFS, and run the same command again.")
        network = (httpx2.TransportError, ConnectionError, TimeoutError)
        if isinstance(exc, network) or isinstance(exc.__cause__, network):
            return NetworkError(f"Cannot reach {host} while {doing}: {_short(exc)}",
                                hint="Check the network, proxy (HTTPS_PROXY) or HF_ENDPOINT; run the same command "
                                     "again: it resumes.")
        return PortError(f"{doing.capitalize()} on {host} failed: {_short(exc)}")

