"""The driver: which step of each job is next (from the journal), the two executors, progress and the summary.

Executors only place steps; neither has a queue or scheduler of its own: `local` is a thread per job slot (one per
free device) handing each step to a standard process pool, `ray` submits each step as a Ray task with its resource
request and lets Ray place and retry it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from porting.errors import UsageError

from .jobs import STEP_ORDER, Job
from .steps import STEPS, Layout, device_of, output_identity, read_record, run_step, step_key, write_record


@dataclass
class JobRun:
    """One job's walk through its steps: finished steps whose key still matches are reused, the rest run."""

    job: Job
    root: Path
    upstream: list[str] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    ran: set[str] = field(default_factory=set)
    position: int = 0
    failed: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(self.root / self.job.name)

    def next_task(self, on_reused: Callable[[str, str], None]) -> dict[str, Any] | None:
        """The next step to run (skipping over current finished ones), or None when the job is over."""
        while not self.failed and self.position < len(self.job.steps):
            step = self.job.steps[self.position]
            key = step_key(self.job, step, self.upstream)
            rec = read_record(self.layout, step)
            out = STEPS[step].out
            if (rec and rec.get("state") == "done" and rec.get("key") == key
                    and (out is None or getattr(self.layout, out).exists())
                    and rec.get("out_identity") == output_identity(step, self.layout)):
                self.records[step] = rec
                self.upstream.append(rec["produced"])
                self.position += 1
                on_reused(self.job.name, step)
                continue
            return {"job": self.job.to_dict(), "step": step, "root": str(self.layout.root), "key": key}
        return None

    def finish(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.records[step] = record
        self.ran.add(step)
        if record["state"] == "done":
            self.upstream.append(record["produced"])
            self.position += 1
        else:
            self.failed = True


def crashed_record(task: dict[str, Any], error: str, lay: Layout) -> dict[str, Any]:
    """The record of a step whose worker died for good (retries spent): written by the driver."""
    record = {"job": task["job"]["name"], "step": task["step"], "key": task["key"], "state": "failed",
              "exit_code": 70, "error": error, "hint": "the worker running it died; rerun the batch to retry",
              "seconds": 0.0, "finished": time.time()}
    write_record(lay, task["step"], record)
    return record


# ---- progress -----------------------------------------------------------------------------------------------

class Progress:
    """One live table (job x step) on a terminal; one line per event otherwise; nothing with --json / --quiet."""

    def __init__(self, runs: list[JobRun], output: Any) -> None:
        self.runs, self.output = runs, output
        self.state: dict[tuple[str, str], str] = {}
        self.lock = threading.Lock()
        self.live = None
        if not output.quiet and output.err.is_terminal:
            from rich.live import Live

            self.live = Live(self._table(), console=output.err, refresh_per_second=4, transient=False)

    def _table(self) -> Any:
        from rich.table import Table

        steps = [s for s in STEP_ORDER if any(s in r.job.steps for r in self.runs)]
        table = Table(title="port batch")
        for col in ("job", *steps):
            table.add_column(col)
        for r in self.runs:
            table.add_row(r.job.name, *[self.state.get((r.job.name, s), "queued" if s in r.job.steps else "")
                                        for s in steps])
        return table

    def event(self, job: str, step: str, state: str, line: str) -> None:
        with self.lock:
            self.state[(job, step)] = state
            if self.live is not None:
                self.live.update(self._table())
            else:
                self.output.status(line)

    def reused(self, job: str, step: str) -> None:
        self.event(job, step, "done (journal)", f"{job}: {step} already done (journal)")

    def started(self, job: str, step: str, where: str = "") -> None:
        self.event(job, step, "running", f"{job}: {step} started{where}")

    def finished(self, rec: dict[str, Any]) -> None:
        if rec["state"] == "done":
            text = f"done {rec['seconds']:.1f}s"
        else:
            text = f"FAILED ({rec['exit_code']})"
        line = f"{rec['job']}: {rec['step']} {text}" + (f": {rec['error']}" if rec["state"] != "done" else "")
        self.event(rec["job"], rec["step"], text, line)

    def __enter__(self) -> Progress:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()


# ---- executors ------------------------------------------------------------------------------------------------

def _device_count(kind: str) -> int:
    if kind == "cpu":
        return 1
    import torch

    if kind == "cuda":
        return torch.cuda.device_count()
    mod = getattr(torch, "npu", None)
    return mod.device_count() if mod is not None else 0


def run_local(runs: list[JobRun], progress: Progress, parallel: int | None) -> None:
    """One job per free device (the devices the jobs ask for), each step in a worker process of a standard
    pool; CPU-only steps run inside the same job slots."""
    kinds = {device_of(r.job, s) for r in runs for s in r.job.steps} - {"cpu"}
    if len(kinds) > 1:
        raise UsageError(f"--executor local runs one kind of accelerator at a time; the jobs ask for "
                         f"{', '.join(sorted(kinds))}.", hint="Split the jobs file, or use --executor ray.")
    kind = kinds.pop() if kinds else "cpu"
    count = _device_count(kind)
    if count == 0:
        raise UsageError(f"the jobs ask for {kind} but this machine has no {kind} device.")
    workers = min(parallel or count, len(runs))
    slots: queue.Queue[int] = queue.Queue()
    for i in range(workers):  # never more slots than jobs: --parallel 10**12 is not a loop of 10**12
        slots.put(i % count)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch or threads

    pools = [cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)]
    pools_lock = threading.Lock()

    def call(task: dict[str, Any], run: JobRun) -> dict[str, Any]:
        pool = pools[-1]
        try:
            return pool.submit(run_step, task).result()
        except cf.process.BrokenProcessPool as e:  # a worker died (OOM kill): this step fails, the batch goes on
            with pools_lock:
                if pools[-1] is pool:
                    pools.append(cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx))
            return crashed_record(task, f"worker process died: {e}", run.layout)
        except Exception as e:  # the worker could not even record the step (its journal write)
            return crashed_record(task, f"{type(e).__name__}: {e}", run.layout)

    def walk(run: JobRun) -> None:
        index = slots.get()
        try:
            while (task := run.next_task(progress.reused)) is not None:
                if kind != "cpu" and device_of(run.job, task["step"]) == kind:
                    dev = str(run.job.options.get(task["step"], {}).get("device", kind))
                    task["device"] = dev if ":" in dev else f"{kind}:{index}"
                progress.started(run.job.name, task["step"], f" on {task['device']}" if task.get("device") else "")
                sent = time.time()
                record = call(task, run)
                record["dispatch_s"] = round(time.time() - sent - record["seconds"], 3)
                run.finish(record)
                progress.finished(record)
        finally:
            slots.put(index)

    try:
        with cf.ThreadPoolExecutor(max_workers=workers) as threads:
            for f in [threads.submit(walk, r) for r in runs]:
                f.result()
    finally:
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


def ray_missing() -> UsageError:
    return UsageError("--executor ray needs Ray, which is not installed.",
                      hint="pip install 'flux-port[ray]'  (or use --executor local)")


RAY_ADDRESS_ENV = "RAY_ADDRESS"


def check_ray_address(address: str | None, timeout: float) -> None:
    """A `HOST:PORT` cluster address (given, or from RAY_ADDRESS) must accept a connection within `timeout`
    seconds; Ray itself would retry an address with nothing there for ever. `auto`, `local` and no address at all
    (a cluster started here) are left to Ray."""
    import socket

    given = address or os.environ.get(RAY_ADDRESS_ENV)
    if not given or given in ("auto", "local"):
        return
    target = given.split("://", 1)[-1]
    host, _, port_text = target.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise UsageError(f"--address {given}: not HOST:PORT (ray start --head prints the address).")
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host.strip("[]"), int(port_text)), timeout=left):
                return
        except OSError as e:
            last = e
            if isinstance(e, socket.timeout) or time.monotonic() + 0.5 >= deadline:
                break
            time.sleep(0.5)  # a head that is starting: try again until the deadline
    why = f" ({last.strerror or last})" if last is not None else ""
    raise UsageError(f"--address {given}: no Ray cluster answered within {timeout:g} s{why}; nothing was run or "
                     "written.", hint="Check the address `ray start --head` printed and that the head is running, "
                                      "or give a longer --connect-timeout.")


def run_ray(runs: list[JobRun], progress: Progress, address: str | None, max_retries: int) -> None:
    """Each step one Ray task with its resource request; Ray places it and retries it when its worker dies."""
    try:
        import ray
    except ImportError:
        raise ray_missing() from None
    started_here = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True, logging_level="ERROR")
        started_here = True
    remote = ray.remote(run_step)
    inflight: dict[Any, tuple[JobRun, dict[str, Any], float]] = {}

    def submit(run: JobRun) -> None:
        task = run.next_task(progress.reused)
        if task is None:
            return
        step = STEPS[task["step"]]
        kind = device_of(run.job, task["step"])
        req: dict[str, Any] = {"num_cpus": 1, "max_retries": max_retries, "retry_exceptions": False}
        if kind == "cuda":
            req["num_gpus"] = 1
        elif kind == "npu":
            req["resources"] = {"NPU": 1}
        if not step.device:
            req["memory"] = int(step.memory_gb * 2**30)
        ref = remote.options(**req).remote(task)
        inflight[ref] = (run, task, time.time())
        asked = ", ".join(f"{k}={v}" for k, v in req.items())
        progress.event(run.job.name, task["step"], "submitted", f"{run.job.name}: {task['step']} submitted ({asked})")

    # Ray's driver threads print worker deaths and task logs to stdout; stdout is the summary's alone (--json)
    with contextlib.redirect_stdout(sys.stderr):
        _drive(ray, runs, submit, inflight, progress, started_here and address is None)


def _drive(ray: Any, runs: list[JobRun], submit: Callable[[JobRun], None], inflight: dict[Any, Any],
           progress: Progress, shutdown: bool) -> None:
    try:
        for run in runs:
            submit(run)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
            for ref in ready:
                run, task, sent = inflight.pop(ref)
                try:
                    record = ray.get(ref)
                except Exception as e:  # the task's worker died more often than max_retries, or Ray failed it
                    record = crashed_record(task, f"{type(e).__name__}: {str(e).splitlines()[0]}", run.layout)
                record["dispatch_s"] = round(time.time() - sent - record["seconds"], 3)
                run.finish(record)
                progress.finished(record)
                submit(run)
    finally:
        for ref in inflight:
            ray.cancel(ref, force=True)
        if shutdown:
            ray.shutdown()


# ---- the summary ------------------------------------------------------------------------------------------------

def summary(runs: list[JobRun], jobs_file: Path, out: Path, executor: str, seconds: float) -> dict[str, Any]:
    jobs = []
    for r in runs:
        steps = []
        for s in r.job.steps:
            rec = r.records.get(s)
            if rec is None:
                steps.append({"step": s, "state": "skipped", "reason": "an earlier step failed"})
                continue
            row = {"step": s, "state": rec["state"], "ran_now": s in r.ran, "seconds": rec.get("seconds")}
            if s in r.ran:  # the driver's view of the step minus its time inside the verb: placing it, waiting for
                row["dispatch_s"] = rec.get("dispatch_s")  # a slot or resource, the worker handing it over
            if rec["state"] != "done":
                row.update(exit_code=rec.get("exit_code"), error=rec.get("error"), hint=rec.get("hint"))
            for k in ("out", "note", "verdict", "produced", "pushed"):
                if rec.get(k) is not None:
                    row[k] = rec[k]
            steps.append(row)
        verdict = r.records.get("validate", {}).get("verdict")
        jobs.append({"name": r.job.name, "source": r.job.source, "source_kind": r.job.source_kind,
                     "base": r.job.base, "folder": str(r.layout.root),
                     "state": "failed" if r.failed else "done",
                     "validate_verdict": verdict, "published": r.records.get("publish", {}).get("published"),
                     "pushed": r.records.get("publish", {}).get("pushed"),
                     "steps": steps})
    counts = {k: sum(1 for j in jobs for s in j["steps"] if s["state"] == k) for k in ("done", "failed", "skipped")}
    return {"format_version": 1, "jobs_file": str(jobs_file), "out": str(out), "executor": executor,
            "seconds": round(seconds, 3), "jobs_done": sum(j["state"] == "done" for j in jobs),
            "jobs_failed": sum(j["state"] == "failed" for j in jobs), "steps": counts,
            "steps_run_now": sum(len(r.ran) for r in runs), "jobs": jobs}


def step_rows(doc: dict[str, Any]) -> list[list[str]]:
    """(job, step, state, seconds, detail) of every step: batch.md's table and the terminal's."""
    rows = []
    for j in doc["jobs"]:
        for s in j["steps"]:
            detail = s.get("error") or s.get("verdict") or s.get("note") or s.get("reason") or ""
            if s["state"] == "failed":
                detail = f"exit {s['exit_code']}: {detail}"
            secs = f"{s['seconds']:.1f}" if s.get("seconds") is not None else ""
            state = s["state"] + ("" if s.get("ran_now", True) else " (journal)")
            rows.append([j["name"], s["step"], state, secs, str(detail)])
    return rows


def markdown(doc: dict[str, Any]) -> str:
    lines = ["# port batch", "", f"jobs file `{doc['jobs_file']}`, executor {doc['executor']}, "
             f"{doc['seconds']:.1f} s; jobs done {doc['jobs_done']}, failed {doc['jobs_failed']}; steps run now "
             f"{doc['steps_run_now']}.", "", "| job | step | state | seconds | detail |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in step_rows(doc)]
    lines += ["", "| job | validate verdict | published |", "|---|---|---|"]
    for j in doc["jobs"]:
        lines.append(f"| {j['name']} | {j['validate_verdict'] or '-'} | {j['published'] or '-'} |")
    return "\n".join(lines) + "\n"


def local_paths(jobs: list[Job], jobs_file: Path) -> dict[str, Any]:
    """Every local path a batch reads: the jobs file, local sources, local bases."""
    return {"jobs file": jobs_file, "source": [j.source for j in jobs if j.source_kind == "local"],
            "base": [j.base for j in jobs if j.base_kind == "local"]}

