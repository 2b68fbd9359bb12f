"""What was validated (the published folder, as its manifest.json lists it) against what a hub lists, and the
model card's line naming the revision an upload produced."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting import __version__
from porting._files import read_json_object
from porting.errors import CheckFailed
from porting.hub.fetch.verify import RemoteFile, file_digests
from porting.known_digests import file_sha256, forget, hash_file
from porting.ownership import RECORD

MANIFEST = "manifest.json"
CARD = "README.md"
# files a hub adds by itself to every repository; never part of the comparison
HUB_FILES = {"hf": {".gitattributes"}, "modelscope": {".gitattributes", "configuration.json"}}


@dataclass(frozen=True)
class LocalFile:
    path: str       # inside the folder, with '/'
    file: Path
    size: int
    sha256: str
    proven: bool = False  # the sha256 is one flux-port took of these very bytes (unchanged file since)


CHANGED_HINT = ("Validate the weights as they are now (port validate), then publish again (port publish ... "
                "--force): the gate compares them with the report.")


def local_identity(folder: Path) -> tuple[dict[str, LocalFile], dict[str, Any]]:
    """Every file of a published folder with the size and sha256 its manifest.json records (plus the manifest
    itself); a folder that no longer matches its manifest by name or size is refused (exit 1)."""
    manifest_path = folder / MANIFEST
    manifest = read_json_object(manifest_path, "written by port publish")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckFailed(f"{manifest_path} has no 'files' table; it was not written by port publish.",
                          hint="Publish the folder again with port publish.")
    files: dict[str, LocalFile] = {}
    for rel, info in listed.items():
        path = folder / rel
        size = path.stat().st_size if path.is_file() else None
        if size is None or size != info.get("bytes") or not isinstance(info.get("sha256"), str):
            raise CheckFailed(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, but {manifest_path} "
                              f"lists {info.get('bytes')} bytes: the folder changed after port publish wrote it; "
                              "nothing was uploaded.", hint="Publish it again (port publish ... --force).")
        known = file_sha256(path)  # recorded, else hashed now (the LFS oid the client would take anyway), recorded
        if known != info["sha256"]:
            raise CheckFailed(f"{path}: sha256 {known}, but {manifest_path} lists {info['sha256']}: the folder "
                              "changed after port publish wrote it; nothing was uploaded.",
                              hint="Publish it again (port publish ... --force).")
        files[rel] = LocalFile(rel, path, size, info["sha256"], proven=True)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink()}
    extra = sorted(on_disk - set(files) - {MANIFEST, RECORD})  # RECORD: flux-port's local ownership seal
    if extra:
        raise CheckFailed(f"{folder / extra[0]} is not listed in {manifest_path} ({len(extra)} such file(s)): the "
                          "folder changed after port publish wrote it; nothing was uploaded.",
                          hint="Remove what was added, or publish again (port publish ... --force).")
    digest, _ = file_digests(manifest_path, git=False)
    files[MANIFEST] = LocalFile(MANIFEST, manifest_path, manifest_path.stat().st_size, digest)
    return dict(sorted(files.items())), manifest


def stale_digests(files: list[LocalFile]) -> list[tuple[LocalFile, str]]:
    """The files whose bytes do not hash to the sha256 recorded for them (each read once more), with their true
    sha256; their records are dropped, so that every later verb hashes them again."""
    stale = []
    for f in files:
        actual = hash_file(f.file)
        if actual != f.sha256:
            forget(f.file)
            stale.append((f, actual))
    return stale


def stale_error(stale: list[tuple[LocalFile, str]], repo: str, rejected: str) -> CheckFailed:
    """What a hub's refusal of a recorded sha256 means once the file was hashed again: it changed after flux-port
    hashed it (an edit in place that kept its size and modification time), so it is not what was validated."""
    f, actual = stale[0]
    more = f" ({len(stale) - 1} more file(s) likewise)" if len(stale) > 1 else ""
    err = CheckFailed(
        f"{f.file}: changed since it was validated and published: its bytes hash to {actual}, manifest.json and "
        f"flux-port's record say {f.sha256}{more}. {repo} refused the upload ({rejected}); nothing of it was "
        "committed, and the record was dropped.",
        hint=CHANGED_HINT, details="\n".join(f"{g.path}: sha256 {a}, recorded {g.sha256}" for g, a in stale))
    err.resumable = False  # type: ignore[attr-defined]  # the same command cannot succeed: no "--force resumes"
    return err


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def difference(local: LocalFile, remote: RemoteFile | None, content: bytes | None = None) -> str | None:
    """Why the hub's file is not the local one, or None when size and hash agree. `content` stands for the local
    file's bytes where they are not those on disk (the stamped model card)."""
    size = len(content) if content is not None else local.size
    if remote is None:
        return "not on the hub"
    if remote.size != size:
        return f"{remote.size:,} bytes on the hub, {size:,} here"
    if remote.sha256:
        want = hashlib.sha256(content).hexdigest() if content is not None else local.sha256
        return None if remote.sha256.lower() == want else f"sha256 {remote.sha256} on the hub, {want} here"
    if remote.git_sha1:
        want = git_sha1(content) if content is not None else file_digests(local.file, git=True)[1]
        return None if remote.git_sha1.lower() == want else f"git blob {remote.git_sha1} on the hub, {want} here"
    return "the hub lists no hash for it"


_STAMP = re.compile(r"\n## Hub revision\n\nThe files of this model were uploaded by flux-port \S+ as revision "
                    r"`([0-9A-Za-z._-]+)` of .*", re.S)


def stamp(card: bytes, repo: str, url: str, revision: str) -> bytes:
    """The model card with the revision the upload produced (sent as its own commit right after that revision)."""
    return card + (
        f"\n## Hub revision\n\nThe files of this model were uploaded by flux-port {__version__} as revision "
        f"`{revision}` of [{repo}]({url}). At that revision the repository holds exactly the published folder: "
        "after the upload flux-port compared the hub's listing (each file's size and sha256 / git blob id) with "
        "`manifest.json`. This section is the only change since. Load exactly those files with "
        f"`from_pretrained(\"{repo}\", revision=\"{revision}\")`.\n").encode()


def stamped_revision(card: bytes, remote: bytes) -> str | None:
    """The revision a hub's model card names, when it is this card plus the stamp, else None."""
    if not remote.startswith(card):
        return None
    m = _STAMP.fullmatch(remote[len(card):].decode("utf-8", "replace"))
    return m.group(1) if m else None
