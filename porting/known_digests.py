"""The sha256 of a file, taken once by the verb that had its bytes in hand, and trusted later without a read.

port fetch hashes a download while verifying it; the writer hashes each shard as it writes it (on another core,
from the page cache). Both keep the digest in a record sealed under this user's key in the state folder, keyed by
the file's device and inode. A later verb (validate, publish, publish --push) takes the digest from there while the
file keeps its device, inode, size and modification time: what a hard link or a rename keeps and what any rewrite
changes. Otherwise the file is read and hashed, as before.

A shard's record may also carry the weights identity of the set of shards written with it (`known_weights`), so
that validate and publish need not read every tensor to name the weights they check.

Trusting the modification time is the same bet `make` and rsync make: a same-size rewrite that puts the nanosecond
mtime back on purpose (`touch -d`) is not noticed (docs/publish.md says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from porting.ownership import (
    SealingKeyError,
    read_state_record,
    recorded_sha256,
    same_file_facts,
    state_folder,
    write_state_record,
)

KIND = "digests"
FORMAT = 1
Range = tuple[int, int]  # a tensor's bytes in its file: (offset, length)
_HEX64 = re.compile(r"[0-9a-f]{64}")
READ = 1 << 20  # bytes per read when a file must be hashed: small enough to stay in the CPU cache


def _stat(path: Path) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _record(st: os.stat_result) -> dict | None:
    try:
        doc = read_state_record(KIND, st)
    except SealingKeyError:
        return None
    if doc is None or doc.get("format_version") != FORMAT or not same_file_facts(doc.get("file"), st):
        return None
    return doc


def known_sha256(path: Path) -> str | None:
    """The sha256 of `path` recorded when it was written or verified, while the file is still as it was then."""
    st = _stat(path)
    if st is None:
        return None
    doc = _record(st)
    if doc is not None and isinstance(doc["file"].get("sha256"), str):
        return str(doc["file"]["sha256"])
    try:
        return recorded_sha256(st)  # port fetch's proof of what it wrote carries the digest it verified
    except SealingKeyError:
        return None


def remember(path: Path, sha256: str, weights: Mapping[str, object] | None = None,
             expect: os.stat_result | None = None, tensors: Mapping[Range, str] | None = None) -> None:
    """Record the sha256 of `path` as it is now (and, for a shard, the weights identity of its set; for a verified
    download, each tensor's sha256 by byte range). `expect`: the file's stat when it was hashed; a file that changed
    since is not recorded. Without a usable sealing key nothing is recorded either: later verbs hash it again."""
    st = os.stat(path)
    if expect is not None and (expect.st_dev, expect.st_ino, expect.st_size, expect.st_mtime_ns) != (
            st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
        return
    doc: dict[str, object] = {"format_version": FORMAT, "path": os.path.abspath(path), "file": {
        "device": st.st_dev, "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}}
    if weights is not None:
        doc["weights"] = dict(weights)
    if tensors:
        doc["tensors"] = {f"{start}:{length}": digest for (start, length), digest in sorted(tensors.items())}
    try:
        write_state_record(KIND, st, doc)
        _prune_once()
    except (SealingKeyError, OSError):
        pass



def known_tensor_digests(path: Path) -> dict[Range, str]:
    """Each tensor's sha256 by byte range, recorded when port fetch verified `path`, while the file is as it was
    then; else {}."""
    st = _stat(path)
    doc = _record(st) if st is not None else None
    digests = doc.get("tensors") if doc is not None else None
    if not isinstance(digests, dict):
        return {}
    known: dict[Range, str] = {}
    for key, digest in digests.items():
        start, _, length = str(key).partition(":")
        if not (start.isdigit() and length.isdigit() and isinstance(digest, str) and _HEX64.fullmatch(digest)):
            return {}
        known[(int(start), int(length))] = digest
    return known


def tensor_digests(files: Iterable[Path]) -> dict[Path, dict[Range, str]]:
    """`known_tensor_digests` of each file that has them: a tensor copied byte for byte reuses its digest instead
    of being read again."""
    known = {}
    for file in files:
        digests = known_tensor_digests(file)
        if digests:
            known[file] = digests
    return known


PRUNE_AT = 4096  # records kept before the stale ones are swept (a few hundred bytes each)
_pruned: set[Path] = set()


def _prune_once() -> None:
    """Once per process, when the records pass `PRUNE_AT`: remove those whose file is gone or changed (by the path
    it was recorded under, or a later rename's, which the inode still finds: such records stay). A record still
    used costs one stat; one removed here is only a digest taken again later."""
    folder = state_folder() / KIND
    if folder in _pruned:
        return
    _pruned.add(folder)
    entries = list(os.scandir(folder))
    if len(entries) <= PRUNE_AT:
        return
    for entry in entries:
        try:
            with open(entry.path, "rb") as f:
                doc = json.loads(f.read(1 << 16))
            st = os.stat(doc["path"])
            if same_file_facts(doc.get("file"), st):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass
        try:
            os.unlink(entry.path)
        except OSError:
            pass


def hash_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of `path`, read front to back."""
    digest = hashlib.sha256()
    buf = memoryview(bytearray(READ))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(buf[:n])
            if on_bytes:
                on_bytes(n)
    return digest.hexdigest()


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of `path`: the recorded one while the file is unchanged, else hashed now (and recorded)."""
    known = known_sha256(path)
    if known is not None:
        if on_bytes:
            on_bytes(path.stat().st_size)
        return known
    digest = hash_file(path, on_bytes)
    remember(path, digest)
    return digest


def shards_record(weights_sha256: str, files: Mapping[str, str]) -> dict[str, object]:
    """What each shard of a set records of the set: its weights identity and every shard's name and sha256."""
    return {"sha256": weights_sha256, "files": dict(files)}


def known_weights(files: Sequence[Path]) -> str | None:
    """The weights identity of the tensors in `files`, when they are exactly a set of shards written together
    and each is unchanged since; None otherwise (the caller hashes the tensors)."""
    if not files or len({Path(f).parent for f in files}) != 1:
        return None
    identities = set()
    for f in files:
        st = _stat(f)
        doc = _record(st) if st is not None else None
        weights = doc.get("weights") if doc else None
        if not isinstance(weights, dict) or not isinstance(weights.get("files"), dict):
            return None
        listed = weights["files"]
        if set(listed) != {Path(g).name for g in files} or listed.get(Path(f).name) != doc["file"].get("sha256"):
            return None
        identities.add(str(weights.get("sha256")))
    return identities.pop() if len(identities) == 1 else None
