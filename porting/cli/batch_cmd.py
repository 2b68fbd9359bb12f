"""`port batch JOBS.toml --out DIR`: many ports, each step a call of an existing verb, resumable (docs/batch.md)."""

from __future__ import annotations

import fcntl
import os
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from porting.errors import CheckFailed, UsageError

from . import _output
from ._options import JsonOpt, OutDirOpt, QuietOpt, at_least

if TYPE_CHECKING:
    from .batch.jobs import Job

BATCH_EXAMPLES = """\b
Examples:
  port batch week.toml --out ./ports-week
  port batch week.toml --out /shared/ports --executor ray --address 10.0.0.1:6379
  port batch week.toml --out ./ports-week --json          (the summary only)
"""


class Executor(str, Enum):
    local = "local"
    ray = "ray"


def batch(
    jobs_file: Annotated[Path, typer.Argument(metavar="JOBS.toml", help="Jobs file: [defaults] and [[job]] tables "
                                              "(docs/batch.md).")],
    out: OutDirOpt,
    executor: Annotated[Executor, typer.Option("--executor", help="local: this machine, one job per free device; "
                                               "ray: each step a Ray task.")] = Executor.local,
    address: Annotated[Optional[str], typer.Option("--address", help="Ray cluster address (ray start --head "
                                                   "prints it); default: RAY_ADDRESS, else a local "
                                                   "cluster.")] = None,
    parallel: Annotated[Optional[int], typer.Option("--parallel", callback=at_least(1), help="Local executor: jobs "
                                                    "at a time (default: one per device).")] = None,
    max_retries: Annotated[int, typer.Option("--max-retries", min=0, max=20, help="Ray: retries of a step whose "
                                             "worker died.")] = 3,
    connect_timeout: Annotated[float, typer.Option("--connect-timeout", min=0.1, max=3600.0, help="Ray: seconds to "
                                                   "wait for the cluster at --address (or RAY_ADDRESS) to answer "
                                                   "before giving up with exit 2.")] = 30.0,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run fetch / convert / validate / publish / compare / export for many models; a rerun redoes nothing
    finished."""
    from .batch.driver import check_ray_address, local_paths, ray_missing
    from .batch.jobs import check_applicable_options, load_jobs
    from .batch.steps import allowed_options, check_job_options

    output = _output.use(json_mode=json_, quiet=quiet)
    if executor == Executor.ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ray_missing() from None
    elif address is not None:
        raise UsageError("--address applies to --executor ray.")
    jobs = load_jobs(jobs_file, allowed_options())
    check_job_options(jobs, jobs_file)  # every value as its verb's command line takes it, before anything exists
    check_applicable_options(jobs, jobs_file)  # and only where it applies
    if executor == Executor.ray:
        check_ray_address(address, connect_timeout)
    elif parallel is not None:  # each worker is an interpreter with torch: they must fit together
        from porting.resources import MEMORY_OVERHEAD, check_ranks_memory, gib

        check_ranks_memory("--parallel", min(parallel, len(jobs)), MEMORY_OVERHEAD,
                           f"a worker interpreter {gib(MEMORY_OVERHEAD)}")
    out = Path(os.path.abspath(out))
    from porting.outputs import check_disjoint, check_writable_parent

    inputs = local_paths(jobs, jobs_file)
    check_writable_parent(out)
    check_disjoint(out, inputs)
    doc = _run_locked(jobs, jobs_file, out, inputs, executor, address, max_retries, parallel, output)
    failed = doc["jobs_failed"]
    if output.json_mode:
        output.document({**doc, **({"exit_code": CheckFailed.exit_code} if failed else {})})
    else:
        _print_summary(output, doc)
    output.status(f"summary: {out / '_batch' / 'batch.json'} and batch.md")
    if failed:
        if output.json_mode:
            raise typer.Exit(CheckFailed.exit_code)
        raise CheckFailed(f"{failed} of {len(jobs)} job(s) failed; see {out / '_batch' / 'batch.md'}.",
                          hint="Fix the cause and run the same command again: finished steps are not redone.")


def _print_summary(output: _output.Output, doc: dict[str, Any]) -> None:
    """batch.md's summary as a terminal shows it: a line and two tables (batch.md keeps the Markdown)."""
    from rich.table import Table

    from .batch.driver import step_rows

    output.result(f"batch summary: jobs file {doc['jobs_file']}, executor {doc['executor']}, {doc['seconds']:.1f} s; "
                  f"jobs done {doc['jobs_done']}, failed {doc['jobs_failed']}; steps run now {doc['steps_run_now']}")
    steps = Table(title="steps")
    for column in ("job", "step", "state", "seconds", "detail"):
        steps.add_column(column)
    verdicts = Table(title="jobs")
    for column in ("job", "validate verdict", "published"):
        verdicts.add_column(column)
    for row in step_rows(doc):
        steps.add_row(*row)
    for j in doc["jobs"]:
        verdicts.add_row(j["name"], j["validate_verdict"] or "-", j["published"] or "-")
    output.table(steps)
    output.table(verdicts)


def _run_locked(jobs: list[Job], jobs_file: Path, out: Path, inputs: dict[str, Any], executor: Executor,
                address: Optional[str], max_retries: int, parallel: Optional[int],
                output: _output.Output) -> dict[str, Any]:
    """Run the jobs into `out` under its lock (one driver per batch folder) and write DIR/_batch; the summary."""
    from .batch.driver import JobRun, Progress, markdown, run_local, run_ray, summary

    out.mkdir(parents=True, exist_ok=True)
    lock = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # one driver per batch folder
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{out}: another port batch is running on this folder.",
                             hint="Wait for it to finish; rerunning afterwards redoes nothing.") from None
        runs = [JobRun(job, out) for job in jobs]
        started = time.time()
        with Progress(runs, output) as progress:
            if executor == Executor.ray:
                run_ray(runs, progress, address, max_retries)
            else:
                run_local(runs, progress, parallel)
        doc = summary(runs, jobs_file.resolve(), out, executor.value, time.time() - started)
        from porting.outputs import atomic_folder

        with atomic_folder(out / "_batch", verb="batch", replace="owned", inputs=inputs) as tmp:
            from porting.errors import redact
            from porting.finite import dumps

            (tmp / "batch.json").write_text(dumps(doc, indent=2) + "\n", encoding="utf-8")
            (tmp / "batch.md").write_text(redact(markdown(doc)), encoding="utf-8")
    finally:
        os.close(lock)
    return doc
