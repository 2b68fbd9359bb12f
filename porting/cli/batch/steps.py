"""The step table (data: which verb, where its outputs go, what it needs) and the worker side of a step.

A step is one call of an existing verb's function, parsed by that verb's own typer command (so its options are
checked exactly as on the command line), with --json so its one document is its result. The worker that ran it
writes the step's journal record (an owned folder DIR/NAME/journal/STEP/) before it returns, so a step that
finished is known finished even when the driver dies right after.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from porting.finite import dumps

from .jobs import Job, push_repo

JOURNAL = "journal"
TEST_CRASH_ENV = "FLUX_PORT_BATCH_TEST_CRASH"  # tests only: "JOB:STEP:MARKER" makes the worker die once
TRACE_ENV = "FLUX_PORT_BATCH_TRACE"  # tests only: a file each step run appends "JOB STEP" to


@dataclass(frozen=True)
class Layout:
    """Where one job's folders are: DIR/NAME/{base,finetune,transformer,reports,published,compare,onnx,journal}."""

    root: Path

    def __getattr__(self, name: str) -> Path:
        folders = {"base_dir": "base", "finetune": "finetune", "transformer": "transformer", "reports": "reports",
                   "published": "published", "compare": "compare", "onnx": "onnx", "journal": JOURNAL}
        if name in folders:
            return self.root / folders[name]
        raise AttributeError(name)


def base_folder(job: Job, lay: Layout) -> Path:
    return Path(job.base) if job.base_kind == "local" else lay.base_dir


# ---- the verbs' argument lists ----------------------------------------------------------------------------

def _recipe(name: str) -> Any:
    from porting.hub.recipes import get_recipe

    return get_recipe(name)


def _part_args(part: Any, hub: str | None) -> list[str]:
    """`port fetch` arguments for one recipe part, from the hub asked for when the part is hosted there (a mirror
    serves what the Hub hosts), else from the part's first hub."""
    if hub is None or not (hub in part.hubs or (hub == "mirror" and "hf" in part.hubs)):
        hub = part.hubs[0]
    prefix = "modelscope" if hub == "modelscope" else "hf"
    args = [f"{prefix}:{part.repo}"] + (["--from", "mirror"] if hub == "mirror" else [])
    args += ["--revision", part.revision] if part.revision else []
    for f in part.files:
        args += ["--file", f]
    for g in part.include:
        args += ["--include", g]
    for g in part.exclude:
        args += ["--exclude", g]
    return args


BASE_INCLUDE = ("model_index.json", "scheduler/", "text_encoder/", "tokenizer/", "vae/", "transformer/config.json",
                "LICENSE*", "README.md")


def fetch_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    """Zero, one or two `port fetch` calls: the base (unless it is a local folder) and the checkpoint."""
    hub = opts.get("from")
    calls = []
    if job.base_kind == "recipe":
        calls.append(_part_args(_recipe(job.base).base, hub) + ["--out", str(lay.base_dir)])
    elif job.base_kind == "hub":
        calls.append([job.base, *[a for g in BASE_INCLUDE for a in ("--include", g)], "--out", str(lay.base_dir)])
    if job.source_kind == "recipe":
        part = _recipe(job.source).finetune
        if part is not None:
            calls.append(_part_args(part, hub) + ["--out", str(lay.finetune)])
    elif job.source_kind == "hub":
        calls.append([job.source, *[a for f in job.files for a in ("--file", f)],
                      *(["--revision", job.revision] if job.revision else []), "--out", str(lay.finetune)])
    if hub == "mirror":  # hf: sources named in the jobs file (recipe parts carry their own --from)
        calls = [c if "--from" in c or not c[0].startswith("hf:") else c + ["--from", "mirror"] for c in calls]
    rest = [a for k, v in opts.items() if k != "from" for a in option_args(k, v)]
    return [c + rest for c in calls]


def _checkpoint(job: Job, lay: Layout) -> Path:
    if job.source_kind == "local":
        return Path(job.source)
    files = sorted(lay.finetune.rglob("*.safetensors")) if lay.finetune.is_dir() else []
    return files[0] if len(files) == 1 else lay.finetune


def convert_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    base = base_folder(job, lay)
    args = [str(_checkpoint(job, lay)), "--out", str(lay.transformer)]
    if (base / "transformer" / "config.json").is_file():
        args += ["--config", str(base)]
    return [args + _force(lay.transformer) + _opts(opts)]


def validate_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    base = base_folder(job, lay)
    args = [str(lay.transformer), "--out", str(lay.reports)]
    if (base / "text_encoder").is_dir():
        args += ["--base", str(base)]
    return [args + _opts(opts)]


def publish_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    args = ["--base", str(base_folder(job, lay)), "--transformer", str(lay.transformer), "--out", str(lay.published)]
    if "skip-validation" not in opts:
        args += ["--report", str(lay.reports)]
    if job.source_kind == "recipe":
        recipe = _recipe(job.source)
        args += [] if "variant" in opts else ["--variant", recipe.variant]
        args += [] if "base-model" in opts else ["--base-model", recipe.base.repo]
    if "push" in opts:
        opts = {**opts, "push": push_repo(job)}
    return [args + _force(lay.published) + _opts(opts)]


def compare_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    return [[str(base_folder(job, lay)), str(lay.published), "--out", str(lay.compare)] + _force(lay.compare) +
            _opts(opts)]


def export_calls(job: Job, lay: Layout, opts: dict[str, Any]) -> list[list[str]]:
    return [[str(lay.published), "--out", str(lay.onnx)] + _force(lay.onnx) + _opts(opts)]


def _force(out: Path) -> list[str]:
    """A step is run again only when the journal says its output is stale: replace it (the verb still replaces
    only a folder flux-port wrote, as --force always does)."""
    return ["--force"] if out.exists() else []


def option_args(key: str, value: Any) -> list[str]:
    flag = f"--{key}"
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{key}"]
    if isinstance(value, list):
        return [a for v in value for a in option_args(key, v)]
    return [flag, str(value)]


def _opts(opts: dict[str, Any]) -> list[str]:
    return [a for k, v in opts.items() for a in option_args(k, v)]


@dataclass(frozen=True)
class Step:
    """One row of the step table."""

    module: str  # the verb's module under porting.cli
    function: str  # the verb's function
    calls: Callable[[Job, Layout, dict[str, Any]], list[list[str]]]
    out: str | None  # the Layout folder it writes (what the journal checks still exists)
    device: bool  # placed on an accelerator when its device option names one
    memory_gb: float  # Ray memory request (logical): fetch and convert stream, export holds a graph
    reserved: frozenset[str]  # options batch sets itself
    positional: frozenset[str]  # the verb's arguments (batch gives them)


_COMMON = frozenset({"out", "json", "quiet", "force", "workspace", "help", "dry-run"})
_F = frozenset
STEPS: dict[str, Step] = {
    "fetch": Step("fetch_cmd", "fetch", fetch_calls, None, False, 0.5,
                  _COMMON | {"file", "include", "exclude", "revision", "finetune-from"}, _F({"source"})),
    "convert": Step("convert_cmd", "convert", convert_calls, "transformer", False, 2.0, _COMMON | {"config"},
                    _F({"src"})),
    "validate": Step("validate_cmd", "validate", validate_calls, "reports", True, 2.0, _COMMON | {"base"},
                     _F({"model"})),
    "publish": Step("publish_cmd", "publish", publish_calls, "published", False, 0.5,
                    _COMMON | {"base", "transformer", "report"}, _F({"recipe"})),
    "compare": Step("compare_cmd", "compare", compare_calls, "compare", True, 2.0, _COMMON,
                    _F({"reference", "candidate"})),
    "export": Step("export_cmd", "export", export_calls, "onnx", False, 4.0, _COMMON, _F({"folder"})),
}


def allowed_options() -> dict[str, set[str]]:
    """Long option names of each step's verb that a jobs file may set (read off the verbs' signatures)."""
    from .._options import _option_names

    out = {}
    for name, step in STEPS.items():
        fn = getattr(importlib.import_module(f"porting.cli.{step.module}"), step.function)
        flags = {flag.removeprefix("--") for param, flag in _option_names(fn).items()
                 if flag.startswith("--") and param not in step.positional}
        out[name] = flags - step.reserved
    return out


@functools.cache
def verb_command(step: str) -> Any:
    """The click command of a step's verb, as `invoke` builds it: its parameters are the checks the command line
    applies (types, choices, ranges, callbacks)."""
    import typer

    fn = getattr(importlib.import_module(f"porting.cli.{STEPS[step].module}"), STEPS[step].function)
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(fn)
    return typer.main.get_command(app)


def check_step_options(step: str, opts: dict[str, Any], where: str) -> None:
    """Every option value a jobs file gives `step`, through the verb's own parameter (type, choices, ranges, its
    callback) as the command line would take it, before any step runs; UsageError (exit 2) naming `where` (the
    file and job), the step and the option. A boolean goes only to a switch, and false only to one with a --no-
    form; a list only to an option that may repeat."""
    from porting.errors import PortError, UsageError

    command = verb_command(step)  # typer's own click: its parameters are told apart by kind, not by class
    by_flag = {o: p for p in command.params if p.param_type_name == "option" for o in p.opts if o.startswith("--")}
    arguments = ["x" for p in command.params if p.param_type_name == "argument" and p.required]  # batch's paths
    for key, value in opts.items():
        param = by_flag.get(f"--{key}")
        what = f"{where}: {step}.{key} = {dumps(value)}"
        if param is None:  # the allowed set is read off the same signature; kept as a guard
            raise UsageError(f"{what}: `port {step}` has no --{key}.")
        if param.is_flag:
            if not isinstance(value, bool):
                raise UsageError(f"{what}: --{key} is a switch of `port {step}`; give true or false.")
            if not value and not param.secondary_opts:
                raise UsageError(f"{what}: `port {step}` has --{key} but no --no-{key}; false cannot be passed.",
                                 hint=f"Leave {key} out for its default (off).")
            continue
        if isinstance(value, bool):
            raise UsageError(f"{what}: --{key} of `port {step}` takes a value, not true or false.")
        if isinstance(value, list) and not param.multiple:
            raise UsageError(f"{what}: --{key} of `port {step}` takes one value, not a list.")
        try:
            command.make_context(f"port {step}", arguments + option_args(key, value))
        except PortError as e:
            raise UsageError(f"{what}: {e.message}", hint=e.hint) from None
        except Exception as e:  # click's (typer's copy) BadParameter, NoSuchOption, ...: a usage error
            if not hasattr(e, "format_message"):
                raise
            raise UsageError(f"{what}: {e.format_message()}", hint=f"See `port {step} --help`.") from None


def check_job_options(jobs: list[Job], jobs_file: Path) -> None:
    """`check_step_options` for every step of every job (the [defaults] merged in), at read time."""
    for i, job in enumerate(jobs):
        for step in job.steps:
            check_step_options(step, job.options.get(step, {}), f"{jobs_file} [[job]] #{i + 1} ({job.name})")


def device_of(job: Job, step: str) -> str:
    """The accelerator kind a step asks for: cpu, cuda or npu."""
    if not STEPS[step].device:
        return "cpu"
    dev = str(job.options.get(step, {}).get("device", "cpu"))
    return dev.split(":")[0] if dev.split(":")[0] in ("cuda", "npu") else "cpu"


# ---- identities and the journal ---------------------------------------------------------------------------

def _sha(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(path: Path) -> Any:
    """Cheap identity of a local file or folder: every file's relative name, size and modification time (the
    rule make and rsync use); a checkpoint's weights hash is what convert produces from it."""
    if path.is_file():
        st = path.stat()
        return [path.name, st.st_size, st.st_mtime_ns]
    if path.is_dir():
        return sorted([str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns]
                      for p in path.rglob("*") if p.is_file() and "journal" not in p.relative_to(path).parts)
    return None


def source_identity(job: Job) -> str:
    """What the first step consumes: the local source and base as they are on disk, or the hub ids asked for."""
    doc = {"source": job.source, "kind": job.source_kind, "files": list(job.files), "revision": job.revision,
           "base": job.base, "base_kind": job.base_kind}
    if job.source_kind == "local":
        doc["source_fp"] = fingerprint(Path(job.source))
    if job.base_kind == "local":
        doc["base_fp"] = fingerprint(Path(job.base))
    return _sha(doc)


def step_key(job: Job, step: str, upstream: list[str]) -> str:
    """A finished step is current while its options, the source identity and what each earlier step produced
    are the same."""
    return _sha({"step": step, "options": job.options.get(step, {}), "source": source_identity(job),
                 "upstream": upstream})


def read_record(lay: Layout, step: str) -> dict[str, Any] | None:
    """The journal record of a finished step; None when there is none. One that cannot be read (not JSON, nested
    deeper than any record is) is refused naming the journal file, not the jobs file."""
    from porting._files import parse_json
    from porting.errors import InputError

    path = lay.journal / step / "step.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse_json(text, str(path), kind=dict, what="the batch journal record")
    except InputError as e:
        raise InputError(f"{e.message} The journal of step {step} is damaged; the jobs file is not at fault.",
                         hint=f"Remove {path.parent} to run that step again.") from None


def output_identity(step: str, lay: Layout) -> str:
    """What a step's output is on disk now (every file's name, size and modification time): a finished step is
    reused only while its output is still what it wrote."""
    out = STEPS[step].out
    targets = (getattr(lay, out),) if out else (lay.root / "finetune", lay.base_dir)
    return _sha([fingerprint(p) for p in targets])


def write_record(lay: Layout, step: str, record: dict[str, Any]) -> None:
    from porting.outputs import atomic_folder

    with atomic_folder(lay.journal / step, verb="batch", replace="owned") as tmp:
        (tmp / "step.json").write_text(dumps(record, indent=2) + "\n", encoding="utf-8")


def produced(step: str, doc: dict[str, Any], lay: Layout) -> str:
    """The hash a step produced: the weights identity where the verb reports one (convert, validate, publish;
    porting/tensors/identity.py; validate's with its report's), else the identity of what it wrote."""
    if doc.get("weights_sha256"):
        key = f"{doc['weights_sha256']}:{doc.get('verdict', '')}"
        if step == "validate":  # publish carries the report: one made under other options is another input
            key += ":" + _sha(fingerprint(lay.reports / "report.json"))
        return key
    out = STEPS[step].out
    target = getattr(lay, out) if out else (lay.root / "finetune", lay.base_dir)
    return _sha([fingerprint(p) for p in (target if isinstance(target, tuple) else (target,))])


# ---- the worker side --------------------------------------------------------------------------------------

def invoke(verb: str, args: list[str]) -> tuple[int, dict[str, Any], str]:
    """Run one verb function in this process as `port VERB ARGS --json --quiet` would: (exit code, its JSON
    document, its stderr)."""
    import click
    import typer

    from porting.errors import PortError

    from .. import _output
    from .._options import checked

    step = STEPS[verb]
    module = importlib.import_module(f"porting.cli.{step.module}")
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(checked(getattr(module, step.function), getattr(module, "preflight", None)))  # as `port VERB`
    command = typer.main.get_command(app)
    out, err = io.StringIO(), io.StringIO()
    code, error = 0, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        _output.current = _output.Output(json_mode=True)
        resources = sys.modules.get("porting.resources")  # an earlier step's memory estimates are not this one's
        if resources is not None:
            resources.ESTIMATES.clear()
        try:
            result = command.main(args=[*args, "--json"], prog_name=f"port {verb}", standalone_mode=False)
            code = result if isinstance(result, int) else 0
        except PortError as e:
            code, error = e.exit_code, {"error": e.message, "hint": e.hint, "details": e.details}
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            code, error = 2, {"error": e.format_message(), "hint": f"See `port {verb} --help`."}
        except OSError as e:  # as `port` reports it (app.os_error): a full disk is 5, anything else 2
            import errno

            code = 5 if e.errno in (errno.ENOSPC, errno.EDQUOT) else 2
            error = {"error": f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}."}
        except Exception as e:  # as `port` maps it (_lastresort): a hostile input is 2, a full disk 5, a bug 70
            from .._lastresort import as_port_error

            mapped = as_port_error(e, args)
            code, error = mapped.exit_code, {"error": mapped.message, "hint": mapped.hint}
            if mapped.exit_code == 70:
                error["hint"] = "This is a bug in flux-port; run the step alone with FLUX_PORT_DEBUG=1."
    text = out.getvalue().strip()
    try:
        doc = json.loads(text) if text else {}
    except json.JSONDecodeError:
        doc = {}
    if error:
        doc = {**doc, **error, "exit_code": code}
    return code, doc, err.getvalue()


def _test_hooks(job: str, step: str) -> None:
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as f:
            f.write(f"{job} {step}\n")
    crash = os.environ.get(TEST_CRASH_ENV)
    if crash:
        cjob, cstep, marker = crash.split(":", 2)
        if (cjob, cstep) == (job, step) and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(3)  # a worker that dies mid-step, as an OOM kill or a lost node does


def run_step(task: dict[str, Any]) -> dict[str, Any]:
    """Worker entry: run one step of one job, write its journal record, return the record."""
    job, step, lay = Job.from_dict(task["job"]), task["step"], Layout(Path(task["root"]))
    opts = dict(job.options.get(step, {}))
    if task.get("device"):
        opts["device"] = task["device"]
    _test_hooks(job.name, step)
    started = time.time()
    calls = STEPS[step].calls(job, lay, opts)
    code, doc, stderr, docs = 0, {}, "", []
    for args in calls:
        code, doc, stderr = invoke(step, args)
        docs.append(doc)
        if code != 0:
            break
    record: dict[str, Any] = {"job": job.name, "step": step, "key": task["key"], "calls": len(calls),
                              "state": "done" if code == 0 else "failed", "exit_code": code,
                              "seconds": round(time.time() - started, 3), "finished": time.time(),
                              "host": os.uname().nodename, "pid": os.getpid()}
    if not calls:
        record["note"] = "nothing to fetch (local source and base)"
    if code == 0:
        record["produced"] = produced(step, doc, lay)
        record["out_identity"] = output_identity(step, lay)
    else:
        record["error"] = doc.get("error") or (stderr.strip().splitlines() or ["failed"])[-1]
        record["hint"] = doc.get("hint")
    if step == "validate":
        record["verdict"] = doc.get("verdict")
        record["reasons"] = doc.get("reasons")
    if step == "publish" and code == 0:
        record["published"] = doc.get("out")
        if doc.get("push"):
            p = doc["push"]
            record["pushed"] = f"{p['hub']}:{p['repo']}@{p['revision']}"
    if STEPS[step].out:
        record["out"] = str(getattr(lay, STEPS[step].out))
    write_record(lay, step, record)
    return record
