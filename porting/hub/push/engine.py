"""The order of a push: preflight (token, owner, repository; reads only) -> [publish assembles the folder behind
the gate] -> compare with the hub -> create the repository if needed -> one commit of what changed -> check the
listing at that revision against the manifest -> a second commit stamping that revision into the model card ->
check again. A push of a folder the hub already holds sends nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from porting import __version__
from porting.errors import CheckFailed, InputError, PortError
from porting.hub.fetch.engine import _known_secrets, _scrubbed
from porting.hub.fetch.verify import RemoteFile

from .identity import (
    CARD,
    HUB_FILES,
    MANIFEST,
    LocalFile,
    difference,
    local_identity,
    stale_digests,
    stale_error,
    stamp,
    stamped_revision,
)
from .target import PushTarget


class Pusher(Protocol):
    hub: str
    target: PushTarget
    exists: bool
    url: str
    client_version: str

    @property
    def secrets(self) -> list[str]: ...
    def preflight(self) -> None: ...
    def head(self) -> str: ...
    def listing(self, revision: str | None = None) -> dict[str, RemoteFile]: ...
    def read(self, path: str, revision: str | None = None) -> bytes: ...
    def create(self, card: bytes = b"") -> None: ...
    def commit(self, adds: list[tuple[str, Path | bytes]], deletes: list[str], message: str,
               description: str, digests: dict[str, str] | None = None) -> str: ...
    def pin(self, revision: str, identity: str) -> str: ...


@dataclass
class PushResult:
    hub: str
    repo: str
    endpoint: str
    url: str
    private: bool
    created: bool
    revision: str                    # the revision holding exactly the published folder
    card_revision: str | None        # the commit that stamped `revision` into the model card (None: none needed)
    uploaded: list[str] = field(default_factory=list)
    uploaded_bytes: int = 0
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0
    checked: int = 0
    seconds: float = 0.0

    @property
    def nothing_uploaded(self) -> bool:
        return not self.uploaded and not self.deleted and self.card_revision is None

    def to_dict(self) -> dict[str, Any]:
        return {"hub": self.hub, "repo": self.repo, "endpoint": self.endpoint, "url": self.url,
                "private": self.private, "created": self.created, "revision": self.revision,
                "card_revision": self.card_revision, "uploaded_files": self.uploaded,
                "uploaded_bytes": self.uploaded_bytes, "deleted_files": self.deleted, "unchanged_files": self.unchanged,
                "nothing_uploaded": self.nothing_uploaded, "checked_files": self.checked,
                "seconds": round(self.seconds, 3)}


def _pusher(target: PushTarget) -> Pusher:
    if target.hub == "modelscope":
        from .ms import MsPusher

        return MsPusher(target)
    from .hf import HfPusher

    return HfPusher(target)


def preflight(target: PushTarget) -> Pusher:
    """Token present and accepted, namespace owned, repository looked up: every refusal before any work."""
    pusher: Pusher | None = None
    try:
        pusher = _pusher(target)
        pusher.preflight()
        return pusher
    except PortError as err:
        raise _scrubbed(err, (pusher.secrets if pusher else []) + _known_secrets()) from None


def commit_text(manifest: dict[str, Any]) -> tuple[str, str]:
    v = manifest.get("validation") or {}
    summary = (f"flux-port {__version__}: {manifest.get('pipeline')} ({manifest.get('variant')}), validation "
               f"{v.get('status', 'unknown')}{'' if v.get('enforced', True) else ' (not enforced)'}")
    description = (f"Validation: {v.get('message', 'not recorded')}\n"
                   f"Transformer weights sha256: {manifest.get('weights_sha256')}\n"
                   "manifest.json lists the sha256 of every file of this commit.")
    return summary, description


def check_landed(pusher: Pusher, revision: str, local: dict[str, LocalFile], card: bytes | None) -> int:
    """Compare the hub's listing at `revision` with the local files (the card as `card` when given); a file that
    differs, is missing or is extra is exit 1 naming it. Returns the number of files checked."""
    remote = pusher.listing(revision)
    ignore = HUB_FILES[pusher.hub]
    problems = [(p, why) for p, f in local.items()
                if (why := difference(f, remote.get(p), card if p == CARD else None))]
    problems += [(p, "on the hub but not in the published folder") for p in sorted(remote)
                 if p not in local and p not in ignore]
    if problems:
        path, why = problems[0]
        more = f" ({len(problems) - 1} more file(s) differ)" if len(problems) > 1 else ""
        raise CheckFailed(f"{path}: {why}, in {pusher.target.repo} at revision {revision} after the upload: what "
                          f"landed is not what was validated{more}.",
                          hint="Do not use that revision. Run the same command again to upload the file again; if "
                               "it persists, the hub or a proxy alters uploads.",
                          details="\n".join(f"{p}: {w}" for p, w in problems))
    return len(local)


def push_folder(pusher: Pusher, folder: Path, say: Callable[[str], None] = lambda text: None) -> PushResult:
    try:
        return _push(pusher, folder, say)
    except PortError as err:
        raise _scrubbed(err, pusher.secrets + _known_secrets()) from None


def _commit(pusher: Pusher, adds: list[tuple[str, Path | bytes]], deleted: list[str], summary: str,
            description: str, known: dict[str, str], local: dict[str, LocalFile]) -> str:
    """The upload commit, its files' LFS oids the recorded sha256 (a hint). A hub that refuses the upload may have
    refused an oid its bytes do not hash to: those files are hashed again, and a record that lied is named as the
    cause (exit 1: the weights changed since validation), not the hub."""
    try:
        return pusher.commit(adds, deleted, summary, description, known)
    except PortError as err:
        stale = stale_digests([local[p] for p in known])
        if stale:
            raise stale_error(stale, pusher.target.repo, err.message) from None
        raise


def _push(pusher: Pusher, folder: Path, say: Callable[[str], None]) -> PushResult:
    started = time.perf_counter()
    t = pusher.target
    local, manifest = local_identity(folder)
    if CARD not in local:
        raise CheckFailed(f"{folder} has no {CARD} (model card); nothing was uploaded.",
                          hint="Publish the folder again with port publish.")
    card = local[CARD].file.read_bytes()
    ignore = HUB_FILES[pusher.hub]
    remote = pusher.listing() if pusher.exists else {}
    theirs = [p for p in remote if p not in ignore]
    if theirs and MANIFEST not in remote:
        raise InputError(f"{t.repo} already holds {len(theirs)} file(s) that port publish did not upload (no "
                         f"{MANIFEST}), e.g. {theirs[0]}; nothing was uploaded.",
                         hint="Push to a new repository name, or empty that repository on the hub first.")
    changed = [p for p, f in local.items() if p != CARD and difference(f, remote.get(p)) is not None]
    deleted = sorted(p for p in remote if p not in local and p not in ignore)
    card_same = difference(local[CARD], remote.get(CARD)) is None
    stamped = None
    if not card_same and remote.get(CARD) is not None and remote[CARD].size > len(card):
        stamped = stamped_revision(card, pusher.read(CARD))
    result = PushResult(t.hub, t.repo, t.source.endpoint, pusher.url, t.private, created=not pusher.exists,
                        revision="", card_revision=None)
    if not changed and not deleted and stamped:
        say(f"{t.source.label}: nothing to upload: revision {stamped} already holds these {len(local)} files and "
            "the model card names it")
        result.revision = stamped
        result.unchanged = len(local)
        result.checked = check_landed(pusher, stamped, local, None)
        check_landed(pusher, pusher.head(), local, stamp(card, t.repo, pusher.url, stamped))
        result.seconds = time.perf_counter() - started
        return result
    if not pusher.exists:
        say(f"creating {'private' if t.private else 'public'} repository {t.source.label} on {t.source.host}")
        pusher.create(card)
    uploads = changed + ([] if card_same else [CARD])
    result.uploaded = sorted(uploads)
    result.uploaded_bytes = sum(local[p].size for p in uploads)
    result.deleted = deleted
    result.unchanged = len(local) - len(uploads)
    if uploads or deleted:
        say(f"uploading {len(uploads)} changed file(s) ({result.uploaded_bytes / 1e6:,.1f} MB) to {t.source.label}"
            f"{f', deleting {len(deleted)}' if deleted else ''}; {result.unchanged} unchanged")
        summary, description = commit_text(manifest)
        known = {p: local[p].sha256 for p in uploads if local[p].proven}  # not hashed once more for the LFS oid
        result.revision = _commit(pusher, [(p, local[p].file) for p in uploads], deleted, summary, description,
                                  known, local)
    else:  # the hub holds the folder already, without the stamped card (a push stopped between its two commits)
        result.revision = pusher.head()
    say(f"checking {t.source.label} at revision {result.revision} against manifest.json")
    result.checked = check_landed(pusher, result.revision, local, None)
    pinned = pusher.pin(result.revision, local[MANIFEST].sha256)
    if pinned != result.revision:  # a tag (ModelScope): checked again at what it points at
        result.revision = pinned
        check_landed(pusher, pinned, local, None)
    stamped_card = stamp(card, t.repo, pusher.url, result.revision)
    result.card_revision = pusher.commit([(CARD, stamped_card)], [], f"flux-port: model card names revision "
                                         f"{result.revision}", "Adds the 'Hub revision' section; no other change.")
    check_landed(pusher, result.card_revision, local, stamped_card)
    result.seconds = time.perf_counter() - started
    return result
