"""One rank of a multi-device validation: its stages in lock step, the carry received from the rank before it and
handed to the one after; rank 0 collects every rank's rows and writes the one report."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from porting.devices import free_memory, resolve_device
from porting.errors import EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_USAGE, PortError

from .distributed_link import Link, _to
from .distributed_plan import Job, RankFailed, split_stages, stage_sizes


@dataclass
class Progress:
    """Where a rank is, for the error that names it."""
    rank: int
    device: str
    stages: list[str] = field(default_factory=list)
    done: int = 0
    phase: str = "starting"

    def where(self) -> str:
        span = f"stages {self.stages[0]}..{self.stages[-1]}" if self.stages else "no stages yet"
        return f"rank {self.rank} ({self.device}, {span}) {self.phase}"


def _reference_for(job: Job, dev: torch.device, config: dict[str, Any], shapes: list[Any], batch: int,
                   stage_of: Callable[[str], str] | None = None) -> torch.device:
    """The golden's device on this rank: its own device when the largest stage and the activations fit in its free
    memory (--reference devices), else the CPU."""
    if job.reference == "cpu" or dev.type == "cpu":
        return torch.device("cpu")
    from porting.resources import check_validate_memory

    free = free_memory(dev)
    if free is None:  # no memory query on this backend: the CPU is the safe place
        return torch.device("cpu")
    try:
        check_validate_memory(config, shapes, resolution=job.resolution, text_len=job.text_len, batch=batch,
                              golden_dtype=job.golden_dtype, dtype=job.dtype, available=free, stage_of=stage_of)
    except PortError:
        return torch.device("cpu")
    return dev


def _on_device(device: str) -> torch.device:
    """The rank's device, made the current one of its kind."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "npu":
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
    return dev


def _runs(job: Job, source: Any, dev: torch.device, ref: torch.device) -> tuple[Any, Any]:
    """The three runs of this rank (golden and intrinsic on `ref`, the device under test on `dev`) and the golden's
    weight counter."""
    from .checks import GoldenWeights
    from .compare import Runs
    from .runners.torch_staged import torch_runner
    from .verdict import DTYPES

    run_dtype, gold_dtype = DTYPES[job.dtype], DTYPES[job.golden_dtype]
    golden_weights = GoldenWeights()
    intrinsic = (torch_runner(source, ref, run_dtype) if job.intrinsic == "native" else
                 torch_runner(source, ref, torch.float32, emulate=run_dtype))
    runs = Runs(torch_runner(source, ref, gold_dtype, golden_weights), intrinsic,
                torch_runner(source, dev, run_dtype, job.device_weight_transform))
    if job.prepare_device_model is not None:
        job.prepare_device_model(runs.device.model)
    return runs, golden_weights


def run_rank(job: Job, rank: int, world: int, device: str, progress: Progress) -> Any:
    """One rank's share of the pipeline; returns the Report on rank 0, None elsewhere."""
    from .checks import check_dequantized
    from .compare import Carry, lockstep_stages, start
    from .inputs import build_inputs
    from .weights import WeightSource

    dev = _on_device(device)
    link = Link(torch.device("cpu") if job.backend == "gloo" else dev)
    progress.phase = "reading the weights"
    source = WeightSource(job.model, job.config)
    shapes = [(k, shape) for k, shape, _ in source.plan.outputs()]
    batch = len(job.seeds) * len(job.timesteps)
    ref = _reference_for(job, dev, source.config, shapes, batch, source.stage_of)
    runs, golden_weights = _runs(job, source, dev, ref)
    names = runs.golden.stage_names()
    ranges = split_stages(stage_sizes(names, runs.golden._modules), world)
    first, stop = ranges[rank]
    mine = [(i, names[i]) for i in range(first, stop)]
    progress.stages = [n for _, n in mine]

    def on_stage(stage: str) -> None:
        progress.done += 1
        progress.phase = (f"in {progress.stages[progress.done]}" if progress.done < len(progress.stages)
                          else "after its last stage")

    inputs = weights = None
    if rank == 0:
        progress.phase = "hashing the weights and building the inputs"
        weights = source.weights_sha256()
        check_dequantized(source)
        inputs = build_inputs(source.config, job.resolution, job.text_len, job.timesteps, job.seeds,
                              Path(job.base) if job.base else None, job.prompt, family=source.detection.family)
        carry = start(runs, inputs.state)
    else:
        progress.phase = f"receiving the activations from rank {rank - 1}"
        (g, i, d), prev = link.recv_states(rank - 1)
        carry = Carry(_to(g, ref), _to(i, ref), _to(d, dev), prev)
    progress.phase = f"in {progress.stages[0]}"
    rows, carry = lockstep_stages(runs, mine, carry, on_stage)
    if rank < world - 1:
        progress.phase = f"sending the activations to rank {rank + 1}"
        link.send_states([carry.golden, carry.intrinsic, carry.device], carry.prev, rank + 1)
        carry = Carry({}, {}, {}, None)  # handed on: nothing of it is needed here any more
    here = {"rank": rank, "device": str(dev), "reference": str(ref), "stages": progress.stages,
            "environment": {"device": runs.device.facts(), "reference": runs.golden.facts()}}
    if rank != 0:
        progress.phase = "sending its rows to rank 0"
        link.send_object((rows, here, (golden_weights.seen, golden_weights.zero)), 0)
        if rank == world - 1:
            out = [carry.outputs()[k] for k in ("golden", "intrinsic", "device")]
            link.send_tensors([(tuple(t.shape), t.dtype) for t in out], out, 0)
        return None
    return _judge(job, link, progress, world, rows, here, golden_weights, source, inputs, weights, dev, ref)


def _judge(job: Job, link: Link, progress: Progress, world: int, rows: list[Any], here: dict[str, Any],
           golden_weights: Any, source: Any, inputs: Any, weights: str | None, dev: torch.device,
           ref: torch.device) -> Any:
    """Rank 0: every other rank's rows and the last rank's final outputs collected, judged and written."""
    from .verdict import RunFacts, verdict

    ranks = [here]
    for r in range(1, world):
        progress.phase = f"collecting the rows of rank {r}"
        more, info, (seen, zero) = link.recv_object(r)
        rows += more
        ranks.append(info)
        golden_weights.seen += seen
        golden_weights.zero += zero
    progress.phase = f"collecting the final outputs from rank {world - 1}"
    g, i, d = link.recv_tensors(world - 1, link.recv_object(world - 1))
    outputs = {"golden": g.cpu(), "intrinsic": i.cpu(), "device": d.cpu()}
    progress.phase = "judging"
    references = [r["reference"] for r in ranks]
    where = RunFacts(device=",".join(job.devices),
                     reference=references[0] if len(set(references)) == 1 else ",".join(references),
                     device_type=dev.type, reference_type=ref.type, facts_device=ranks[0]["environment"]["device"],
                     facts_reference=ranks[0]["environment"]["reference"], runtime="torch", localises=True,
                     localisation_note="")
    extra = {"distributed": {"backend": job.backend, "world_size": world, "devices": job.devices,
                             "reference": job.reference, "ranks": ranks,
                             "note": "pipeline stages over several devices; every number is what a single-device "
                                     "run with the same device type and reference computes"}}
    report = verdict(rows, outputs, where, source, inputs, dtype=job.dtype, golden_dtype=job.golden_dtype,
                     model=job.model, max_ratio=job.max_ratio, intrinsic=job.intrinsic, weights_sha256=weights,
                     golden_weights=golden_weights, extra=extra)
    if job.out is not None:
        progress.phase = "writing the report"
        report.write(Path(job.out), inputs=job.read_paths)
    return report


def rank_main(job: Job, rank: int, world: int, device: str, store: Any = None) -> Any:
    """Join the process group, run this rank, leave the group; errors name the rank and the stage."""
    import torch.distributed as dist

    progress = Progress(rank, device)
    timeout = _dt.timedelta(seconds=job.timeout_s)
    try:
        progress.phase = "joining the process group"
        if store is not None:
            dist.init_process_group(job.backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(job.backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        try:
            return run_rank(job, rank, world, device, progress)
        finally:
            dist.destroy_process_group()
    except PortError as e:
        raise RankFailed(f"{progress.where()}: {e.message}", hint=e.hint, exit_code=e.exit_code) from e
    except torch.OutOfMemoryError as e:
        raise RankFailed(f"{progress.where()}: out of device memory: {e}".rstrip(), exit_code=EXIT_USAGE,
                         hint="Spread the model over more devices, lower --resolution / --text-len or the number of "
                              "cases, or keep the golden on the CPU (--reference cpu).") from e
    except Exception as e:
        from porting.resources import allocation_failed, out_of_memory

        if allocation_failed(e):  # the host's allocator (a cpu rank): exit 2 with the rank's estimate, not a bug
            oom = out_of_memory(e)
            raise RankFailed(f"{progress.where()}: {oom.message}", hint=oom.hint, exit_code=EXIT_USAGE) from e
        comm = _is_comm(e)
        raise RankFailed(f"{progress.where()}: {type(e).__name__}: {e}".rstrip(),
                         hint=("another rank probably failed first; its message is the cause" if comm else
                               "FLUX_PORT_DEBUG=1 shows the traceback."),
                         exit_code=EXIT_CHECK_FAILED if comm else EXIT_INTERNAL) from e


def _secondary(e: BaseException) -> bool:
    """A communication error that follows another rank's failure (its peer went away), not a cause of its own."""
    cause = e.__cause__ if isinstance(e, RankFailed) and e.__cause__ is not None else e
    return not isinstance(cause, PortError) and _is_comm(cause)


def _is_comm(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("gloo", "nccl", "hccl", "connection", "timed out", "timeout", "peer", "closed",
                                   "distbackend", "socket"))
