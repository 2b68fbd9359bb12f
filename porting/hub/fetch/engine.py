"""The order of a fetch: list -> refuse unsafe paths -> plan -> (dry run stops) -> disk check -> transfer ->
verify -> manifest. For a recipe every part is planned before anything is transferred."""

from __future__ import annotations

import errno
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from rich.console import Console

from porting import errors, known_digests
from porting.errors import CheckFailed, DiskSpaceError, InputError, NetworkError, PortError, add_secret
from porting.hub.recipes import Recipe
from porting.hub.workspace import recipe_paths, record_step
from porting.outputs import UnsafeOutputError
from porting.ownership import file_is_flux_ports, write_file_record

from . import manifest
from .paths import PARTIAL_DIR, check_listing
from .plan import Listing, Plan, PlannedFile, check_disk_space, choose, human, local_state
from .progress import FetchProgress, FileBar
from .sources import Source, hub_for, resolve_endpoint
from .verify import Range, RemoteFile, mismatch


class Interrupted(errors.Interrupted):
    """Ctrl-C during a fetch: what was downloaded stays, and the next run continues from it."""


@dataclass
class FetchOptions:
    revision: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    dry_run: bool = False
    send_token: bool = False
    timeout: float = 60.0
    retries: int = 3


@dataclass
class Reporter:
    """Where the engine's messages go; console=None shows no progress bars."""

    status: Callable[[str], None] = lambda text: None
    warning: Callable[[str], None] = lambda text: None
    console: Console | None = None


class Backend(Protocol):
    hub: str
    source: Source
    token_sent: bool
    token_withheld: bool
    client_version: str

    def listing(self, revision: str | None) -> Listing: ...
    def partial_path(self, out: Path, remote: RemoteFile) -> Path: ...
    def download(self, remote: RemoteFile, out: Path, listing: Listing, bar: FileBar) -> Path: ...


def make_backend(source: Source, opts: FetchOptions) -> Backend:
    if source.hub == "modelscope":
        from .ms_backend import MsBackend
        return MsBackend(source, send_token=opts.send_token, timeout=opts.timeout, retries=opts.retries)
    from .hf_backend import HfBackend
    return HfBackend(source, send_token=opts.send_token, timeout=opts.timeout)


@dataclass
class PartRun:
    plan: Plan
    backend: Backend
    fetched: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    manifest_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        skipped = [f.remote.path for f in self.plan.files if f.state == "verified"]
        return {**self.plan.to_dict(), "fetched": self.fetched, "already_verified": skipped,
                "adopted": self.adopted, "manifest": str(self.manifest_path) if self.manifest_path else None}


@dataclass
class FetchResult:
    parts: list[PartRun]
    dry_run: bool
    recipe: Recipe | None = None
    port_json: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"dry_run": self.dry_run}
        if self.recipe:
            doc.update(recipe=self.recipe.name, variant=self.recipe.variant, pipeline=self.recipe.pipeline,
                       port_json=str(self.port_json) if self.port_json else None)
        doc["total_bytes"] = sum(p.plan.total_bytes for p in self.parts)
        doc["missing_bytes"] = sum(p.plan.missing_bytes for p in self.parts)
        doc["parts"] = [p.to_dict() for p in self.parts]
        return doc


# -- planning -----------------------------------------------------------------------------------------------------
def _with_retries(what: Callable[[], Any], opts: FetchOptions, ui: Reporter) -> Any:
    for attempt in range(opts.retries + 1):
        try:
            return what()
        except NetworkError as err:
            if attempt >= opts.retries:
                raise
            wait = min(2 ** attempt, 30)
            ui.warning(f"{err.message} Retrying in {wait} s ({attempt + 1}/{opts.retries}).")
            time.sleep(wait)  # backoff between attempts, not synchronisation


def plan_part(part: str, source: Source, out: Path, opts: FetchOptions, ui: Reporter) -> PartRun:
    backend = make_backend(source, opts)
    if backend.token_withheld:
        ui.warning(f"A token was found but is not sent to {source.host} (not the hub's own host); "
                   f"pass --send-token if you trust it.")
    ui.status(f"{part}: listing {source.label} on {source.endpoint} ...")
    listing: Listing = _with_retries(lambda: backend.listing(opts.revision), opts, ui)
    # the whole listing is checked, not only the selection: a hub that names such paths is not to be trusted
    check_listing([f.path for f in listing.files], out, source.repo)
    chosen = choose(listing, source.repo, opts.include, opts.exclude, opts.files)
    records = manifest.recorded(manifest.load(out))
    files = [local_state(f, out, records, lambda r: backend.partial_path(out, r)) for f in chosen]
    selection = {"include": opts.include, "exclude": opts.exclude, "files": opts.files}
    plan = Plan(part=part, source=source, out=out, listing=listing, selection=selection, files=files,
                token_sent=backend.token_sent)
    return PartRun(plan=plan, backend=backend)


# -- transfer -----------------------------------------------------------------------------------------------------
def _verify(path: Path, remote: RemoteFile, progress: FetchProgress,
            tensors: dict[Range, str]) -> tuple[str | None, str | None]:
    """(problem or None, sha256); a .safetensors file's per-tensor sha256 go into `tensors` from the same reads
    (convert reuses them for tensors it copies byte for byte: known_digests.known_tensor_digests)."""
    with progress.file(f"verify {remote.path}", remote.size, counts=False) as bar:
        return mismatch(path, remote, on_bytes=bar.update, tensors=tensors)


def _transfer_one(run: PartRun, pf: PlannedFile, opts: FetchOptions, ui: Reporter,
                  progress: FetchProgress) -> Path:
    plan, backend, remote = run.plan, run.backend, pf.remote

    def attempt() -> Path:
        part = backend.partial_path(plan.out, remote)
        have = part.stat().st_size if part.is_file() else 0
        with progress.file(remote.path, remote.size, have) as bar:
            return backend.download(remote, plan.out, plan.listing, bar)

    return _with_retries(attempt, opts, ui)


def run_part(run: PartRun, opts: FetchOptions, ui: Reporter) -> PartRun:
    plan, backend = run.plan, run.backend
    out = plan.out
    previous = manifest.recorded(manifest.load(out))
    doc = manifest.new({"source": plan.source.label, "hub": plan.source.hub, "repo": plan.source.repo,
                        "endpoint": plan.source.endpoint, "revision": plan.listing.revision,
                        "commit": plan.listing.commit, "selection": plan.selection,
                        "client": {"huggingface_hub" if backend.hub == "hf" else "modelscope_hub":
                                   backend.client_version}})
    doc["files"] = [previous[f.remote.path] for f in plan.files if f.state == "verified"]
    run.manifest_path = manifest.save(out, doc)
    todo = [f for f in plan.files if f.state != "verified"]
    if not todo:
        ui.status(f"{plan.part}: all {len(plan.files)} file(s) already verified in {out}")
    with FetchProgress(ui.console, plan.missing_bytes) as progress:
        stale: dict[str, str] = {}  # files fetch wrote that the listing no longer names: replaced below
        for pf in [f for f in todo if f.state == "unchecked"]:  # before any transfer: a file in the way is refused
            remote, dest = pf.remote, out / pf.remote.path
            tensors: dict[Range, str] = {}
            problem, sha256 = _verify(dest, remote, progress, tensors)
            if problem is None:
                run.adopted.append(remote.path)
                _remember(dest, sha256, tensors)
                doc["files"].append(manifest.file_record(remote, dest, sha256, tensors))
                manifest.save(out, doc)
            elif file_is_flux_ports(dest):
                stale[remote.path] = problem
            else:
                raise UnsafeOutputError(
                    f"{dest}: already in {out}, does not match the listing ({problem}), and flux-port did not "
                    "write it (no sealed record of this machine's flux-port for this very file); it was left as it "
                    "is and nothing was downloaded.",
                    hint="Move the file away (or choose another --out) and run the command again.")
        for pf in todo:
            remote, dest = pf.remote, out / pf.remote.path
            if remote.path in run.adopted:
                continue
            if remote.path in stale:
                ui.warning(f"{remote.path} already in {out} does not match the listing ({stale[remote.path]}); "
                           f"flux-port wrote it, downloading it again.")
                dest.unlink()
            got = _transfer_one(run, pf, opts, ui, progress)
            tensors = {}
            problem, sha256 = _verify(got, remote, progress, tensors)
            if problem is not None:
                got.unlink(missing_ok=True)
                raise CheckFailed(
                    f"{remote.path} from {plan.source.label} ({plan.source.host}) is corrupt: {problem}. "
                    f"The file was deleted, not kept.",
                    hint="Run the command again to download it afresh; if it happens again the endpoint serves "
                         "damaged data: try another --from or --endpoint.")
            write_file_record(got, "fetch", destination=dest, sha256=sha256)  # proof that fetch wrote it
            if got != dest:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(got, dest)
            run.fetched.append(remote.path)
            _remember(dest, sha256, tensors)
            doc["files"].append(manifest.file_record(remote, dest, sha256, tensors))
            manifest.save(out, doc)
    doc["complete"] = True
    run.manifest_path = manifest.save(out, doc)
    _remove_if_empty(out / PARTIAL_DIR)
    return run


def _remember(dest: Path, sha256: str | None, tensors: dict[Range, str]) -> None:
    """The file's sha256 and its per-tensor digests go to the one digest store (porting.known_digests), where
    convert, publish and push find them."""
    if sha256:
        known_digests.remember(dest, sha256, tensors=tensors)


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def _execute(runs: list[PartRun], opts: FetchOptions, ui: Reporter,
             free: Callable[[Path], int] | None = None) -> list[PartRun]:
    if opts.dry_run:
        return runs
    for r in runs:
        p = r.plan
        at = f"{p.listing.revision} -> {p.listing.commit[:12]}" if p.listing.commit else p.listing.revision
        ui.status(f"{p.part}: {p.source.label} at {at}: {len(p.files)} file(s), {human(p.total_bytes)}, "
                  f"{human(p.missing_bytes)} to download into {p.out}")
    check_disk_space([r.plan for r in runs], free)
    return [run_part(r, opts, ui) for r in runs]


def _scrubbed(err: PortError, secrets: list[str]) -> PortError:
    """Make sure no token can reach the terminal through a message that quotes a server or client: the tokens the
    clients found (a login file's) become secrets of this run (errors.redact), and the error's texts are redacted."""
    for secret in secrets:
        add_secret(secret)
    for name in ("message", "hint", "details"):
        setattr(err, name, getattr(err, name))  # redacted as set, now with these secrets too
    return err


def _local_error(err: OSError) -> PortError:
    """A failure of the local disk (not of a client): full disk, permissions, a folder where a file should go."""
    where = err.filename or "the output folder"
    if err.errno == errno.ENOSPC:
        return DiskSpaceError(f"The disk filled up while writing {where}.",
                              hint="Free some space and run the same command again: it resumes.")
    return PortError(f"Cannot write {where}: {err.strerror or err}.",
                     hint="Check the permissions of the output folder, or choose another --out / --workspace.")


def _known_secrets() -> list[str]:
    values = [os.environ.get(k, "") for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN")]
    if "huggingface_hub" in sys.modules:  # also the token of `hf auth login`, when the client was loaded
        values.append(sys.modules["huggingface_hub"].get_token() or "")
    if "modelscope_hub" in sys.modules:   # and of `modelscope login`
        values.append(sys.modules["modelscope_hub"].get_default_config().token or "")
    return [v for v in values if v]


# -- entry points -------------------------------------------------------------------------------------------------
def fetch_source(source: Source, out: Path, opts: FetchOptions, ui: Reporter) -> FetchResult:
    """Fetch files of one repository into `out` (plain files, no cache links)."""
    try:
        run = plan_part("source", source, Path(os.path.abspath(out)), opts, ui)
        return FetchResult(parts=_execute([run], opts, ui), dry_run=opts.dry_run)
    except PortError as err:
        raise _scrubbed(err, _known_secrets()) from None
    except OSError as err:
        raise _scrubbed(_local_error(err), _known_secrets()) from err


def recipe_sources(recipe: Recipe, via: str | None, endpoint: str | None, finetune_via: str | None,
                   ui: Reporter) -> dict[str, Source]:
    """Which hub and endpoint each part of the recipe comes from."""
    sources: dict[str, Source] = {}
    for name, part in recipe.parts().items():
        wanted = finetune_via if (name == "finetune" and finetune_via) else via
        hub = hub_for(wanted) if wanted else part.hubs[0]
        part_via = wanted
        if hub not in part.hubs:
            if name == "finetune" and not finetune_via:
                hub, part_via = part.hubs[0], None
                ui.status(f"finetune: {part.repo} is only on {', '.join(part.hubs)}; fetching it from there "
                          f"(--finetune-from mirror uses hf-mirror.com).")
            else:
                raise InputError(f"Recipe {recipe.name}: the {name} repo {part.repo} is not listed on {hub}.",
                                 hint=f"Use --from {' or '.join(part.hubs)}.")
        # --endpoint belongs to the --from choice; a part that falls back to another hub ignores it
        own_endpoint = endpoint if part_via == via else None
        sources[name] = Source(hub=hub, repo=part.repo, endpoint=resolve_endpoint(hub, part_via, own_endpoint))
    return sources


def fetch_recipe(recipe: Recipe, via: str | None, endpoint: str | None, finetune_via: str | None,
                 workspace: Path | None, opts: FetchOptions, ui: Reporter) -> FetchResult:
    """Fetch a recipe's base into <workspace>/<recipe>/base/ and its checkpoint into .../finetune/."""
    paths = recipe_paths(recipe.name, workspace)
    try:
        runs = []
        for name, source in recipe_sources(recipe, via, endpoint, finetune_via, ui).items():
            part = recipe.parts()[name]
            part_opts = FetchOptions(revision=part.revision, include=list(part.include),
                                     exclude=list(part.exclude), files=list(part.files), dry_run=opts.dry_run,
                                     send_token=opts.send_token, timeout=opts.timeout, retries=opts.retries)
            runs.append(plan_part(name, source, Path(os.path.abspath(getattr(paths, name))), part_opts, ui))
        done = _execute(runs, opts, ui)
    except PortError as err:
        raise _scrubbed(err, _known_secrets()) from None
    except OSError as err:
        raise _scrubbed(_local_error(err), _known_secrets()) from err
    result = FetchResult(parts=done, dry_run=opts.dry_run, recipe=recipe)
    if not opts.dry_run:
        result.port_json = record_step(paths, "fetch", {
            "time": manifest.now(), "recipe": recipe.name, "variant": recipe.variant, "pipeline": recipe.pipeline,
            **{r.plan.part: {"source": r.plan.source.label, "endpoint": r.plan.source.endpoint,
                             "revision": r.plan.listing.revision, "commit": r.plan.listing.commit,
                             "folder": str(r.plan.out), "manifest": str(r.manifest_path),
                             "files": len(r.plan.files), "bytes": r.plan.total_bytes} for r in done}})
    return result


__all__ = ["FetchOptions", "FetchResult", "Interrupted", "Reporter", "fetch_recipe", "fetch_source"]
