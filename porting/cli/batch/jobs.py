"""The jobs file: [defaults] and [[job]] tables, checked before any work (unknown keys and options are exit 2)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from porting.errors import UsageError

STEP_ORDER = ("fetch", "convert", "validate", "publish", "compare", "export")
JOB_KEYS = {"name", "source", "files", "revision", "base", "steps", *STEP_ORDER}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_MAX = 200  # DIR/NAME/ and the hidden staging folders next to its outputs stay within 255-byte file names


@dataclass(frozen=True)
class Job:
    """One model to port. `source`: a known recipe, `hf:ORG/NAME` / `modelscope:ORG/NAME` (with `files`), or a
    local checkpoint path (absolute here). `base`: a local diffusers folder (absolute), a recipe name or a hub id."""

    name: str
    source: str
    source_kind: str  # recipe | hub | local
    base: str | None
    base_kind: str | None  # local | recipe | hub | None
    steps: tuple[str, ...]
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # step -> {long option name: value}
    files: tuple[str, ...] = ()
    revision: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "source_kind": self.source_kind, "base": self.base,
                "base_kind": self.base_kind, "steps": list(self.steps), "options": self.options,
                "files": list(self.files), "revision": self.revision}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Job:
        return cls(name=d["name"], source=d["source"], source_kind=d["source_kind"], base=d["base"],
                   base_kind=d["base_kind"], steps=tuple(d["steps"]), options=d["options"],
                   files=tuple(d["files"]), revision=d["revision"])


def _is_hub(text: str) -> bool:
    return text.startswith(("hf:", "modelscope:"))


def _known_recipe(text: str) -> bool:
    from porting.errors import InputError
    from porting.hub.recipes import get_recipe

    try:
        get_recipe(text)
        return True
    except InputError:
        return False


def _where(i: int | None, name: str | None = None) -> str:
    return "[defaults]" if i is None else f"[[job]] #{i + 1}" + (f" ({name})" if name else "")


def _check_options(where: str, step: str, raw: Any, allowed: dict[str, set[str]]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: {step} must be a table of {step}'s long option names, e.g. "
                         f"{step} = {{ device = \"cpu\" }}.")
    for key, value in raw.items():
        if key not in allowed[step]:
            raise UsageError(f"{where}: {step}.{key} is not an option batch can pass to `port {step}`.",
                             hint=f"Options of port {step} that batch passes: {', '.join(sorted(allowed[step]))} "
                                  "(batch sets the paths, --out, --force, --json itself).")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise UsageError(f"{where}: {step}.{key} = {v!r} is not a finite number.",
                                 hint="Give it a finite value, or leave it out for its default.")
            if not isinstance(v, (str, int, float, bool)):
                raise UsageError(f"{where}: {step}.{key} must be a string, number, boolean or a list of them.")
    return dict(raw)


def _check_steps(where: str, steps: Any) -> tuple[str, ...]:
    if not isinstance(steps, list) or not steps or any(s not in STEP_ORDER for s in steps):
        raise UsageError(f"{where}: steps must be a non-empty list of {', '.join(STEP_ORDER)}; got {steps!r}.")
    if list(steps) != sorted(set(steps), key=STEP_ORDER.index):
        raise UsageError(f"{where}: steps {steps} are not in the order {' -> '.join(STEP_ORDER)} (or repeat one).")
    return tuple(steps)


def _resolve(text: str, here: Path) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else (here / path)


def load_jobs(path: Path, allowed: dict[str, set[str]]) -> list[Job]:
    """Parse and check a jobs file; `allowed[step]` are the option names batch may pass to that step's verb."""
    defaults, raw_jobs = _read(path)
    here = path.resolve().parent
    jobs: list[Job] = []
    for i, raw in enumerate(raw_jobs):
        name = raw.get("name") if isinstance(raw, dict) else None
        where = f"{path} {_where(i, name if isinstance(name, str) else None)}"
        if not isinstance(raw, dict):
            raise UsageError(f"{where}: a job is a table.")
        bad = set(raw) - JOB_KEYS
        if bad:
            raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(bad))}.",
                             hint=f"A job may set: {', '.join(sorted(JOB_KEYS))}.")
        _check_name(path, i, where, name, jobs)
        merged = {**defaults, **raw}
        kind, source, files = _source(where, merged, here)
        base, base_kind = _base(where, merged.get("base"), here)
        if base is None and kind == "recipe":
            base_kind, base = "recipe", source
        steps = _check_steps(where, merged.get("steps", ["convert", "validate", "publish"]))
        options = {s: {**_check_options(f"{path} [defaults]", s, defaults.get(s, {}), allowed),
                       **_check_options(where, s, raw.get(s, {}), allowed)} for s in steps}
        revision = merged.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise UsageError(f"{where}: revision must be a string.")
        jobs.append(Job(name=name, source=source, source_kind=kind, base=base, base_kind=base_kind, steps=steps,
                        options=options, files=tuple(files), revision=revision))
    _check_pushes(path, jobs)
    return jobs


def _read(path: Path) -> tuple[dict[str, Any], list[Any]]:
    """The jobs file's [defaults] and its [[job]] tables, each table's keys checked against what it may set."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such jobs file.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not a valid TOML jobs file ({e}).") from None
    unknown = set(doc) - {"defaults", "job"}
    if unknown:
        raise UsageError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}; a jobs file has [defaults] and "
                         "[[job]] tables.")
    defaults = doc.get("defaults", {})
    raw_jobs = doc.get("job", [])
    if not isinstance(defaults, dict) or not isinstance(raw_jobs, list) or not raw_jobs:
        raise UsageError(f"{path}: no [[job]] tables; list at least one job.")
    bad = set(defaults) - (JOB_KEYS - {"name", "source", "files"})
    if bad:
        raise UsageError(f"{path} [defaults]: unknown key(s) {', '.join(sorted(bad))}.",
                         hint=f"[defaults] may set: base, steps, revision, {', '.join(STEP_ORDER)}.")
    return defaults, raw_jobs


def _check_name(path: Path, i: int, where: str, name: Any, jobs: list[Job]) -> None:
    """A job's name: a plain folder name, not reserved, not too long, not another job's."""
    if isinstance(name, str) and name.startswith("_") and _NAME.fullmatch(name[1:]):
        raise UsageError(f"{where}: name {name!r} is reserved: names starting with '_' are batch's own folders "
                         "(DIR/_batch holds its summary).", hint="Rename the job; any name without a leading "
                                                                  "'_' is fine.")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UsageError(f"{where}: name must be a plain folder name (letters, digits, '.', '_', '-'); "
                         f"got {name!r}.")
    if len(name) > NAME_MAX:
        raise UsageError(f"{path} {_where(i)} ({name[:40]}...): name is {len(name)} characters long; at most "
                         f"{NAME_MAX} (it becomes the "
                         "folder DIR/NAME/, and a file name holds at most 255 bytes).",
                         hint="Give the job a shorter name.")
    if name in {j.name for j in jobs}:
        raise UsageError(f"{where}: two jobs are named {name}; each job writes DIR/NAME/.")


def _source(where: str, merged: dict[str, Any], here: Path) -> tuple[str, str, list[str]]:
    """(kind, source, files) of a job: a hub id with its files, a known recipe, or a local path made absolute."""
    source = merged.get("source")
    if not isinstance(source, str) or not source.strip():
        raise UsageError(f"{where}: source must name a recipe, hf:ORG/NAME, modelscope:ORG/NAME or a file.")
    files = merged.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise UsageError(f"{where}: files must be a list of file paths in the repository.")
    if _is_hub(source):
        kind = "hub"
        if not files:
            raise UsageError(f"{where}: source {source} needs files = [\"...safetensors\"] (the checkpoint).")
    elif _known_recipe(source) and not _resolve(source, here).exists():
        kind = "recipe"
    else:
        kind, source = "local", str(_resolve(source, here))
    if kind != "hub" and files:
        raise UsageError(f"{where}: files applies to a hf: or modelscope: source only.")
    return kind, source, files


def _base(where: str, base: Any, here: Path) -> tuple[str | None, str | None]:
    """(base, kind) of a job's base: a hub id, a local folder made absolute, or a known recipe; (None, None)."""
    if base is None:
        return None, None
    if not isinstance(base, str) or not base.strip():
        raise UsageError(f"{where}: base must name a folder, a recipe or a hub id.")
    if _is_hub(base):
        return base, "hub"
    if _resolve(base, here).exists():
        return str(_resolve(base, here)), "local"
    if _known_recipe(base):
        return base, "recipe"
    raise UsageError(f"{where}: base {base!r} is neither a folder, a known recipe nor a hub id.")


def check_applicable_options(jobs: list[Job], jobs_file: Path) -> None:
    """Each job's convert options against `APPLIES["convert"]`, as `port convert` checks them once it has read the
    source: an adapter when an adapter-only option is given, else weights (a refusal here is one the step would
    meet). Run after `check_job_options`, so the values are the verb's own."""
    from porting.errors import PortError

    from .._options import APPLIES, check_applicable, convert_given, convert_kind

    for i, job in enumerate(jobs):
        opts = {k.replace("_", "-"): v for k, v in job.options.get("convert", {}).items()}
        if "convert" not in job.steps or not opts:
            continue
        given = convert_given(
            lora_style=opts.get("lora-style"), materialise=bool(opts.get("materialise")), rank=opts.get("rank"),
            calibrate=opts.get("calibrate"), device=str(opts.get("device", "cpu")), to=str(opts.get("to", "diffusers")),
            dtype=str(opts.get("dtype", "keep")), quantize=opts.get("quantize"))
        adapter = any(given[o] is not None and APPLIES["convert"][o].kinds == {"adapter"} for o in given)
        quantize = opts.get("quantize")
        try:
            check_applicable("convert", convert_kind("adapter" if adapter else "weights", quantize), given,
                             src=job.source, quantize=quantize, out="--out DIR")
        except PortError as e:
            raise UsageError(f"{jobs_file} {_where(i, job.name)}: convert: {e.message}", hint=e.hint) from None


def push_repo(job: Job) -> str | None:
    """The repository a job's publish step pushes to: publish.push with `{job}` replaced by the job's name."""
    value = job.options.get("publish", {}).get("push")
    return None if value is None else str(value).replace("{job}", job.name)


def _check_pushes(path: Path, jobs: list[Job]) -> None:
    """publish.push names ORG/NAME for each job, and no two jobs push to one repository."""
    from porting.errors import InputError
    from porting.hub.push.target import check_push_name

    seen: dict[str, str] = {}
    for job in jobs:
        repo = push_repo(job)
        if repo is None:
            continue
        try:
            publish = job.options.get("publish", {})
            check_push_name(repo, str(publish.get("push-to", publish.get("push_to", "hf"))))
            bad = f"is also job {seen[repo]}'s repository; each job needs its own" if repo in seen else None
        except InputError as e:
            bad = ("is not a repository id of the form ORG/NAME" if "form ORG/NAME" in e.message
                   else e.message.split(": ", 1)[1].rstrip("."))
        if bad:
            raise UsageError(f"{path} ({job.name}): publish.push = {repo!r} {bad}.",
                             hint='Write "my-org/NAME" in the job, or "my-org/{job}" in [defaults] for one '
                                  "repository per job.")
        seen[repo] = job.name
