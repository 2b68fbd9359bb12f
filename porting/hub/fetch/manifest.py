"""fetch-manifest.json: what was fetched, from where, at which commit, with sizes and hashes. Never a token.

It is rewritten after every verified file, so a run that is killed keeps the record of what it finished, and
the next run skips those files without hashing them again (same size and modification time as recorded).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from porting import __version__
from porting._files import parse_json
from porting.errors import InputError
from porting.hub.workspace import write_json_atomic

from .paths import MANIFEST_NAME
from .verify import Range, RemoteFile

FORMAT_VERSION = 1


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load(out_dir: Path) -> dict[str, Any]:
    """The previous manifest, or {} when there is none or it cannot be read (then every file is re-checked)."""
    try:
        doc = parse_json((out_dir / MANIFEST_NAME).read_bytes(), str(out_dir / MANIFEST_NAME))
    except (OSError, InputError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("format_version") == FORMAT_VERSION else {}


def recorded(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in doc.get("files", []) if isinstance(f, dict) and "path" in f}


def still_verified(record: dict[str, Any] | None, remote: RemoteFile, local: Path) -> bool:
    """True when `local` is the file a previous run verified against the same expected content."""
    if not record or record.get("size") != remote.size:
        return False
    if remote.sha256 and record.get("sha256") != remote.sha256:
        return False
    if not remote.sha256 and remote.git_sha1 and record.get("git_sha1") != remote.git_sha1:
        return False
    try:
        st = local.stat()
    except OSError:
        return False
    return st.st_size == remote.size and st.st_mtime_ns == record.get("mtime_ns")


def file_record(remote: RemoteFile, local: Path, sha256: str | None,
                tensors: Mapping[Range, str] | None = None) -> dict[str, Any]:
    record = {"path": remote.path, "size": remote.size, "sha256": sha256 or remote.sha256,
              "git_sha1": remote.git_sha1, "verified_by": remote.check, "mtime_ns": os.stat(local).st_mtime_ns}
    if tensors:  # per-tensor sha256 by byte range, "start:length" -> digest (taken with the file's own sha256)
        record["tensors_sha256"] = {f"{start}:{length}": digest for (start, length), digest in sorted(tensors.items())}
    return record


def new(header: dict[str, Any]) -> dict[str, Any]:
    """A manifest for this run; `header` holds source, hub, repo, endpoint, revision, commit, selection."""
    return {"format_version": FORMAT_VERSION, "tool": f"flux-port {__version__}", **header,
            "started": now(), "updated": now(), "complete": False, "files": []}


def save(out_dir: Path, doc: dict[str, Any]) -> Path:
    doc["updated"] = now()
    doc["files"] = sorted(doc["files"], key=lambda f: f["path"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MANIFEST_NAME
    write_json_atomic(path, doc)
    return path
