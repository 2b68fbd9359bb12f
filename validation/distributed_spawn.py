"""Ranks spawned on this host: one process per device, the first error of any rank raised as the verb's error, the
others terminated."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from porting.errors import EXIT_CHECK_FAILED, PortError

from .distributed_plan import TIMEOUT_ENV, Job, RankFailed
from .distributed_rank import _secondary, rank_main


def _spawned(index: int, job: Job, world: int, host: str, port: int) -> None:
    """A rank started by `spawn`: its report or its error goes to the result folder; exit code as the verb's."""
    import sys

    import torch.distributed as dist

    os.environ.update({"RANK": str(index), "WORLD_SIZE": str(world), "LOCAL_RANK": str(index),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": host, "MASTER_PORT": str(port)})
    folder = Path(job.result_dir or ".")
    try:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=_dt.timedelta(seconds=job.timeout_s))
        report = rank_main(job, index, world, job.devices[index], store)
        if report is not None:
            with open(folder / "report.pkl.part", "wb") as f:
                pickle.dump(report, f)
            os.replace(folder / "report.pkl.part", folder / "report.pkl")
    except BaseException as e:  # record it for the launcher, then leave with the verb's exit code
        code = e.exit_code if isinstance(e, PortError) else 70
        record = {"rank": index, "message": getattr(e, "message", str(e)), "hint": getattr(e, "hint", None),
                  "exit_code": code, "time": time.time(), "secondary": _secondary(e),
                  "traceback": traceback.format_exc()}
        (folder / f"rank{index}.error.json").write_text(json.dumps(record))
        sys.exit(code)


def spawn(job: Job) -> Any:
    """Start one process per device on this host, wait, and return rank 0's report (or raise the first error)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    world = len(job.devices)
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                          timeout=_dt.timedelta(seconds=job.timeout_s))  # port 0: the OS picks a free one
    with tempfile.TemporaryDirectory(prefix="flux-port-ranks-") as tmp:
        job.result_dir = tmp
        context = mp.start_processes(_spawned, args=(job, world, host, store.port), nprocs=world, join=False,
                                     start_method=_start_method())
        # torch logs a warning per rank it terminates after a failure; the one error raised below says what happened
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        try:
            while not context.join(timeout=1.0):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            _terminate(context)
            raise _first_error(Path(tmp), e, job.timeout_s) from None
        except KeyboardInterrupt:
            _terminate(context)
            raise
        finally:
            del store
        result = Path(tmp) / "report.pkl"
        if not result.is_file():
            raise RankFailed("rank 0 finished without a report.", exit_code=70)
        with open(result, "rb") as f:
            return pickle.load(f)


# modules every rank imports: a forkserver imports them once, and each rank starts as a fork of it (importing torch
# and diffusers takes seconds per process; the server never computes, so no thread pool or device is forked)
PRELOAD = ["torch", "torch.distributed", "diffusers.models.transformers.transformer_flux2", "validation.api",
           "validation.distributed", "validation.distributed_rank", "validation.distributed_spawn"]


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def _terminate(context: Any) -> None:
    for p in context.processes:
        if p.is_alive():
            p.terminate()
    for p in context.processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _first_error(folder: Path, exc: BaseException, timeout: float) -> PortError:
    records = []
    for path in folder.glob("rank*.error.json"):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    if records:
        records.sort(key=lambda r: (r["secondary"], r["time"]))
        first = records[0]
        if os.environ.get("FLUX_PORT_DEBUG"):
            print(first["traceback"])
        hint = first["hint"]
        if first["secondary"]:  # nobody failed of its own: the rank waited for is hung or slower than the timeout
            hint = (f"No rank reported an error of its own: the rank it waited for is hung, or slower than the "
                    f"timeout ({TIMEOUT_ENV}={timeout:g} s); raise {TIMEOUT_ENV} for a large model on slow devices.")
        return RankFailed(first["message"], hint=hint, exit_code=first["exit_code"])
    code = getattr(exc, "exit_code", None)
    sig = getattr(exc, "signal_name", None)
    rank = getattr(exc, "error_index", "?")
    how = f"was killed by {sig}" if sig else f"exited with code {code}"
    hint = "SIGKILL is often the kernel's out-of-memory killer; see dmesg." if sig == "SIGKILL" else None
    return RankFailed(f"rank {rank} {how} before it could report an error.", hint=hint, exit_code=EXIT_CHECK_FAILED)

