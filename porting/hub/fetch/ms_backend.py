"""ModelScope through its client (modelscope_hub, the package `modelscope` delegates its hub I/O to).

`modelscope_hub` is imported directly rather than `modelscope.hub.*`: the latter are thin shims over it, and
importing `modelscope` also loads torch and its plugin indexer (seconds per run) for nothing.

Planning: `HubApi.list_repo_files(revision=...)` gives paths, sizes and SHA-256. ModelScope names no commit for a
branch, so the manifest records the revision name and every file's SHA-256 (which pins the content).
Transfer, per file: `HubApi.downloader.download_file(local_dir=out, expected_sha256=, file_size=)`. The client
resumes by itself, also across runs, from `<out>/<path>.incomplete` with a `Range` request.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from porting.errors import AuthError, CheckFailed, DiskSpaceError, InputError, NetworkError, PortError

from .plan import Listing
from .progress import FileBar
from .sources import Source
from .verify import RemoteFile


class MsBackend:
    hub = "modelscope"

    def __init__(self, source: Source, *, send_token: bool, timeout: float, retries: int) -> None:
        self.source = source
        self.timeout = timeout
        # modelscope_hub reads its network settings from the environment when it is first imported
        t = str(int(max(1, timeout)))
        os.environ.update({"MODELSCOPE_API_TIMEOUT": t, "MODELSCOPE_API_CONNECT_TIMEOUT": t,
                           "MODELSCOPE_DOWNLOAD_TIMEOUT": t, "MODELSCOPE_API_MAX_RETRIES": str(max(1, retries)),
                           "MODELSCOPE_DOWNLOAD_MAX_RETRIES": str(max(1, retries))})
        import modelscope_hub
        from modelscope_hub import HubApi, get_default_config

        self.client_version = getattr(modelscope_hub, "__version__", "?")
        found = get_default_config().token  # MODELSCOPE_API_TOKEN, else the `modelscope login` cookie
        allowed = source.official or send_token
        # token="" tells the client to send none, also not the stored login cookie
        self.api = HubApi(endpoint=source.endpoint, token=None if allowed else "")
        self.token_sent = bool(found) and allowed
        self.token_withheld = bool(found) and not allowed

    def listing(self, revision: str | None) -> Listing:
        rev = revision or "master"
        try:
            entries = self.api.list_repo_files(self.source.repo, "model", revision=rev)
        except PortError:
            raise
        except Exception as exc:
            raise self.translate(exc, revision=rev) from exc
        files = [RemoteFile(path=e.path, size=int(e.size), sha256=(e.sha256 or None))
                 for e in entries if not e.is_dir]
        return Listing(revision=rev, commit=None, files=files)

    def partial_path(self, out: Path, remote: RemoteFile) -> Path:
        return (out / remote.path).with_name(Path(remote.path).name + ".incomplete")

    def download(self, remote: RemoteFile, out: Path, listing: Listing, bar: FileBar) -> Path:
        """Let the client fetch (and resume) the file into out/<path>; flux-port verifies it afterwards."""
        from modelscope_hub import ProgressCallback

        try:
            return Path(self.api.downloader.download_file(
                repo_id=self.source.repo, repo_type="model", file_path=remote.path, revision=listing.revision,
                local_dir=out, expected_sha256=remote.sha256, file_size=remote.size,
                progress_callbacks=[bar.ms_callback_class(ProgressCallback)]))
        except PortError:
            raise
        except Exception as exc:
            raise self.translate(exc, revision=listing.revision, path=remote.path) from exc

    def translate(self, exc: BaseException, revision: str, path: str | None = None) -> PortError:
        import requests
        from modelscope_hub import errors as ms

        src, repo, host = self.source, self.source.repo, self.source.host
        cause = _root(exc)
        if isinstance(cause, ms.FileDownloadError) and getattr(cause, "failed_files", None):
            cause = _root(next(iter(cause.failed_files.values())))
        withheld = (f" Your ModelScope token was not sent because {host} is not modelscope.cn; pass "
                    f"--send-token if you trust this endpoint.") if self.token_withheld else ""
        if isinstance(cause, ms.AuthenticationError):
            return AuthError(f"{repo} on {host} needs a ModelScope token (HTTP 401).",
                             hint=f"Accept the licence on {src.repo_url} and set MODELSCOPE_API_TOKEN (or run "
                                  f"`modelscope login`).{withheld}")
        if isinstance(cause, ms.PermissionDeniedError):
            return AuthError(f"The ModelScope token has no access to {repo} (HTTP 403 from {host}).",
                             hint=f"Request access on {src.repo_url} with the account of your token.")
        if isinstance(cause, ms.NotExistError):
            what = f"{path} in {repo}" if path else repo
            return InputError(f"ModelScope ({host}) has no {what} at revision {revision!r}: {cause.message}",
                              hint="Check the repository id and --revision (ModelScope's default branch is "
                                   f"master). If it is private, set MODELSCOPE_API_TOKEN.{withheld}")
        if isinstance(cause, ms.FileIntegrityError):
            return CheckFailed(f"{path}: ModelScope kept sending content that does not match the listed size or "
                               f"SHA-256 ({cause.message}); nothing was kept.",
                               hint="Retry later; if it persists, the repository or the endpoint is corrupt.")
        if isinstance(cause, (ms.NetworkError, ms.ServerError, ms.RateLimitError, requests.ConnectionError,
                              requests.Timeout, TimeoutError, ConnectionError)):
            return NetworkError(f"Cannot fetch {path or repo} from {host}: {_short(cause)}",
                                hint="Check the network or --endpoint; re-running resumes partial files "
                                     f"(timeout {self.timeout:g} s, see --timeout).")
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return DiskSpaceError(f"The disk filled up while fetching {path}.",
                                  hint="Free some space and run the same command again: it resumes.")
        return PortError(f"Fetching {path or repo} from {host} failed: {_short(cause)}")


def _root(exc: BaseException) -> BaseException:
    """The modelscope_hub error behind wrappers (the compat layer re-raises as requests.HTTPError)."""
    from modelscope_hub.errors import HubError

    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        if isinstance(cur, HubError):
            return cur
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return exc


def _short(exc: Any) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
