"""The Hugging Face Hub (or a mirror of it) through huggingface_hub: listing, resumable transfer, error mapping.

Planning: `HfApi.repo_info` resolves the revision to a commit, `list_repo_tree(revision=commit)` gives paths,
sizes, the git blob SHA-1 of regular files and the SHA-256 of LFS files.

Transfer, per file: `get_hf_file_metadata` (the client's HEAD, with its redirect and CDN rules) gives the download
location; the client's `http_get` streams it into `<out>/.fetch-partial/<content hash>.part`, opened for append with
`resume_size` set to what is already there. huggingface_hub resumes only within one call (its own `.incomplete`
files are unique per process and deleted on failure); the stable, content-named partial file lets a later run —
also after the process was killed — continue with a `Range: bytes=<have>-` request through the same client.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from porting.errors import AuthError, CheckFailed, DiskSpaceError, InputError, NetworkError, PortError

from .paths import PARTIAL_DIR
from .plan import Listing
from .progress import FileBar
from .sources import Source
from .verify import RemoteFile


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port


class HfBackend:
    hub = "hf"

    def __init__(self, source: Source, *, send_token: bool, timeout: float) -> None:
        self.source = source
        self.timeout = timeout
        # huggingface_hub reads HF_HUB_DOWNLOAD_TIMEOUT when it is imported; the constant is also set below
        # for the case where another verb imported it first in this process.
        os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = str(int(max(1, timeout)))
        import huggingface_hub
        from huggingface_hub import constants

        constants.HF_HUB_DOWNLOAD_TIMEOUT = max(1, timeout)
        _bound_all_requests(timeout)
        self.client_version = huggingface_hub.__version__
        found = huggingface_hub.get_token()
        allowed = source.official or send_token
        self.token: str | bool = found if (found and allowed) else False
        self.token_withheld = bool(found) and not allowed

    @property
    def token_sent(self) -> bool:
        return bool(self.token)

    # -- planning ---------------------------------------------------------------------------------------------
    def listing(self, revision: str | None) -> Listing:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        api = HfApi(endpoint=self.source.endpoint, token=self.token)
        rev = revision or "main"
        try:
            commit = api.repo_info(self.source.repo, revision=rev, timeout=self.timeout).sha
            if not commit:
                raise InputError(f"{self.source.endpoint} did not say which commit {rev!r} of {self.source.repo} "
                                 f"is.", hint="The endpoint does not look like a Hub-compatible server.")
            entries = api.list_repo_tree(self.source.repo, recursive=True, revision=commit)
            files = [RemoteFile(path=e.path, size=int(e.size),
                                sha256=e.lfs.sha256 if e.lfs else None,
                                git_sha1=None if e.lfs else e.blob_id)
                     for e in entries if isinstance(e, RepoFile)]
        except PortError:
            raise
        except Exception as exc:  # every client error is translated by one table
            raise self.translate(exc, revision=rev) from exc
        return Listing(revision=rev, commit=commit, files=files)

    # -- transfer ---------------------------------------------------------------------------------------------
    def partial_path(self, out: Path, remote: RemoteFile) -> Path:
        return out / PARTIAL_DIR / f"{remote.key}.part"

    def download(self, remote: RemoteFile, out: Path, listing: Listing, bar: FileBar) -> Path:
        """Bring all bytes of `remote` into its partial file and return that file (not yet verified)."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        part = self.partial_path(out, remote)
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > remote.size:
            part.unlink()
            have = 0
        try:
            url = hf_hub_url(self.source.repo, remote.path, revision=listing.commit, endpoint=self.source.endpoint)
            meta = get_hf_file_metadata(url, token=self.token, timeout=self.timeout, endpoint=self.source.endpoint)
            if meta.size is not None and meta.size != remote.size:
                raise CheckFailed(f"{remote.path}: the listing of {self.source.repo} says {remote.size:,} bytes but "
                                  f"the download endpoint says {meta.size:,}; nothing was kept.",
                                  hint="The hub or mirror is inconsistent; retry later or use another --from.")
            headers = build_hf_headers(token=self.token)
            if _origin(meta.location) != _origin(self.source.endpoint):
                # a CDN or storage host: it gets a signed URL, never the Hub token
                headers.pop("authorization", None)
            with open(part, "ab") as fh:
                http_get(meta.location, fh, resume_size=have, headers=headers, expected_size=remote.size,
                         displayed_filename=remote.path, tqdm_class=bar.tqdm_class())
        except PortError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
                # more or fewer bytes than announced: the partial cannot be trusted for a resume
                part.unlink(missing_ok=True)
            raise self.translate(exc, revision=listing.commit or listing.revision, path=remote.path) from exc
        return part

    # -- errors -----------------------------------------------------------------------------------------------
    def translate(self, exc: BaseException, revision: str, path: str | None = None) -> PortError:
        """One table from huggingface_hub / httpx2 errors to flux-port errors (exit codes 2, 3, 4, 5)."""
        import httpx2
        from huggingface_hub import errors as hf

        src, repo, host = self.source, self.source.repo, self.source.host
        withheld = (f" Your Hugging Face token was not sent because {host} is not huggingface.co; pass "
                    f"--send-token if you trust this endpoint.") if self.token_withheld else ""
        if isinstance(exc, hf.GatedRepoError):  # subclass of RepositoryNotFoundError: must come first
            status = exc.response.status_code if exc.response is not None else None
            if status == 403:
                return AuthError(f"{repo} is gated and the token sent is not on its authorized list (HTTP 403 "
                                 f"from {host}).",
                                 hint=f"Accept the licence / request access on {src.repo_url} with the account of "
                                      f"your HF_TOKEN and wait for approval, or use --from modelscope.")
            return AuthError(f"{repo} is gated: {host} wants a token of an account that accepted its licence "
                             f"(HTTP {status or 401}).",
                             hint=f"Accept the licence on the repo page {src.repo_url}, then set HF_TOKEN (or run "
                                  f"`hf auth login`), or use --from modelscope.{withheld}")
        if isinstance(exc, hf.DisabledRepoError):
            return InputError(f"{repo} is disabled on {host}.")
        if isinstance(exc, hf.RepositoryNotFoundError):
            return InputError(f"Repository {repo} was not found on {src.endpoint}.",
                              hint="Check the spelling (ORG/NAME, case matters). If it is private or gated, set "
                                   f"HF_TOKEN.{withheld}")
        if isinstance(exc, hf.RevisionNotFoundError):
            return InputError(f"Revision {revision!r} does not exist in {repo} on {host}.",
                              hint="Use a branch, tag or commit of the repository (default: main).")
        if isinstance(exc, (hf.RemoteEntryNotFoundError, hf.EntryNotFoundError)):
            return InputError(f"{path or 'A file'} is not in {repo} at {revision} on {host}.",
                              hint="Run with --dry-run to see the files the repository lists.")
        if isinstance(exc, hf.FileMetadataError):
            return InputError(f"{src.endpoint} does not answer like a Hugging Face Hub endpoint: {exc}",
                              hint="Check --endpoint / HF_ENDPOINT; a mirror must serve the Hub's API.")
        if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None:
            status = exc.response.status_code
            if status in (401, 403):
                return AuthError(f"{host} refused access to {repo} (HTTP {status}).",
                                 hint=f"Set HF_TOKEN to a token with read access.{withheld}")
            if status == 404:
                return InputError(f"{host} answered 404 for {path or repo}.")
            if status == 429 or status >= 500:
                return NetworkError(f"{host} answered HTTP {status} for {path or repo}.",
                                    hint="The server is busy or failing; retry later or use another --from.")
        timeout_types: tuple[type[BaseException], ...] = (httpx2.TimeoutException, TimeoutError)
        if isinstance(exc, timeout_types) or isinstance(exc.__cause__, timeout_types):
            return NetworkError(f"{host} did not answer within {self.timeout:g} s"
                                f"{f' while fetching {path}' if path else ''}.",
                                hint="Check the network or proxy (HTTPS_PROXY); raise --timeout for slow links; "
                                     "re-running resumes what was already downloaded.")
        network = (httpx2.TransportError, hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled, ConnectionError)
        if isinstance(exc, network) or isinstance(exc.__cause__, network):
            return NetworkError(f"Cannot reach {host}{f' for {path}' if path else ''}: {_short(exc)}",
                                hint="Check the network, proxy (HTTPS_PROXY) or --endpoint; with no access to "
                                     "huggingface.co try --from mirror or --from modelscope.")
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return DiskSpaceError(f"The disk filled up while fetching {path}.",
                                  hint="Free some space and run the same command again: it resumes.")
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            return NetworkError(f"{path}: the transfer ended with a different size than announced "
                                f"({_short(exc)}).", hint="Run the command again; the file restarts from zero.")
        return PortError(f"Fetching {path or repo} from {host} failed: {_short(exc)}")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


_BOUND: dict[str, float] = {}


def _bound_all_requests(timeout: float) -> None:
    """Give every request of huggingface_hub's shared HTTP client a timeout.

    Some client calls (the tree listing) pass timeout=None, which would wait forever on a server that accepts the
    connection and never answers. A request hook fills in the missing timeouts; it is installed through the public
    `set_client_factory`, so it survives the client being recreated after a connection error.
    """
    _BOUND["timeout"] = timeout
    if _BOUND.get("installed"):
        return
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http as hf_http

    def bound(request: Any) -> None:
        current = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {k: (current.get(k) if current.get(k) is not None else _BOUND["timeout"])
                                         for k in ("connect", "read", "write", "pool")}

    def factory() -> Any:
        client = hf_http.default_client_factory()
        client.event_hooks["request"].append(bound)
        return client

    set_client_factory(factory)
    _BOUND["installed"] = 1.0
