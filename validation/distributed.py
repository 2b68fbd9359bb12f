"""`port validate MODEL --devices cuda:0,cuda:1`: the staged run split as pipeline stages over several devices.

Every rank runs the same lock-step loop as a single-device run (`validation.compare.lockstep_stages`) over its own
contiguous range of stages (balanced by parameter count), with the golden, the intrinsic run and the device under
test all on that rank. The carry between stages (the three runs' states and the previous stage's errors) is handed
to the next rank with `torch.distributed` send/recv: a description of every tensor (shape, dtype) first, then the
tensors. Rank 0 builds the inputs, collects every rank's rows and the last rank's final outputs, and writes the one
report through the same `verdict` and `Report.write` a single-device run uses. Because every stage sees the same
input bits as in a single process and computes on the same kind of device, the numbers are the same.

Launch: under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set by it; `--devices`
names the devices of one host, indexed by LOCAL_RANK; `--nnodes M` for several hosts), or, without those variables,
the verb spawns one process per device on this host itself. Backends: gloo on CPU, NCCL on CUDA, HCCL on Ascend
(torch_npu, imported only then). A failing rank surfaces as one error naming the rank and the stage; the others are
torn down (spawned: terminated by the launcher here; torchrun: by its agent), and every collective has a timeout.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting.devices import DeviceSpec, free_memory, parse_device, resolve_device
from porting.errors import EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_USAGE, DeviceError, PortError, UsageError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
TIMEOUT_ENV = "FLUX_PORT_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 3600.0  # a rank waits for every stage upstream of it; a dead or hung peer is noticed by then
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
OPTION = "--devices"


class RankFailed(PortError):
    """One rank of a multi-device validation failed; carries that rank's own exit code."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_CHECK_FAILED):
        super().__init__(message, hint)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------------------------- the device list


def parse_devices(devices: str | Sequence[str], option: str = OPTION) -> list[DeviceSpec]:
    """Two or more devices of one type, no device twice (cpu may repeat: each rank is its own process)."""
    items = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else [str(d).strip() for d in devices]
    if not items or any(not d for d in items):
        raise UsageError(f"{option} {','.join(items)!r}: give two or more comma-separated devices, e.g. cuda:0,cuda:1.")
    specs = []
    for text in items:
        try:
            specs.append(parse_device(text))
        except DeviceError as e:
            raise UsageError(f"{option}: {e.message}", hint=e.hint) from None
    if len(specs) < 2:
        raise UsageError(f"{option} {items[0]}: a pipeline needs two or more devices; for one device use --device "
                         f"{items[0]}.")
    kinds = sorted({s.type for s in specs})
    if len(kinds) > 1:
        raise UsageError(f"{option} {','.join(items)}: mixes device types ({', '.join(kinds)}); every rank must use "
                         "the same type, since one process group has one backend.")
    kind = kinds[0]
    if kind not in BACKENDS:
        raise UsageError(f"{option} {','.join(items)}: {kind} has no torch.distributed backend flux-port uses "
                         f"(supported: {', '.join(BACKENDS)}).")
    if kind != "cpu":
        seen: dict[int, str] = {}
        for text, spec in zip(items, specs):
            index = spec.index or 0
            if index in seen:
                raise UsageError(f"{option} {','.join(items)}: {text} and {seen[index]} are the same device; each rank "
                                 "needs its own.")
            seen[index] = text
    return specs


def check_backend(specs: list[DeviceSpec], option: str = OPTION) -> str:
    """The backend for these devices, available and with every device present; exit 2 naming the option if not."""
    import torch.distributed as dist

    kind = specs[0].type
    backend = BACKENDS[kind]
    listed = ",".join(map(str, specs))
    if not dist.is_available():
        raise DeviceError(f"{option} {listed}: this torch ({torch.__version__}) was built without torch.distributed.")
    if kind == "cpu" and not dist.is_gloo_available():
        raise DeviceError(f"{option} {listed}: the gloo backend is not available in this torch ({torch.__version__}).")
    if kind == "cuda" and not dist.is_nccl_available():
        raise DeviceError(f"{option} {listed}: the NCCL backend is not available in this torch ({torch.__version__}, "
                          f"CUDA {torch.version.cuda}).", hint="Install a CUDA build of torch with NCCL.")
    for spec in specs:  # imports torch_npu for npu, checks each index exists
        try:
            resolve_device(str(spec))
        except DeviceError as e:
            raise DeviceError(f"{option}: {e.message}", hint=e.hint) from None
    if kind == "npu" and not _hccl_available():
        raise DeviceError(f"{option} {listed}: torch_npu is installed but registers no HCCL backend.",
                          hint="Check the torch_npu and CANN versions (source the CANN set_env.sh).")
    return backend


def _hccl_available() -> bool:
    import torch.distributed as dist

    names = getattr(dist.Backend, "backend_list", None)
    return "hccl" in names if names is not None else hasattr(dist.Backend, "HCCL")


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in LAUNCH_ENV)


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < 1e7):
        raise UsageError(f"{TIMEOUT_ENV}={text!r}: seconds, a positive number.")
    return value


# ------------------------------------------------------------------------------------------------------ the job


@dataclass
class Job:
    """Everything a rank needs; picklable (spawned ranks receive it)."""
    model: str
    devices: list[str]
    backend: str
    dtype: str
    golden_dtype: str
    reference: str  # "cpu" or "devices" (each rank's own device when it has room, else the CPU)
    out: str | None
    resolution: int
    text_len: int
    timesteps: list[float]
    seeds: list[int]
    base: str | None
    prompt: str | None
    max_ratio: float
    config: str | None
    intrinsic: str
    read_paths: dict[str, Any]
    timeout_s: float
    device_weight_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    prepare_device_model: Callable[[torch.nn.Module], None] | None = None
    result_dir: str | None = None  # spawned: where rank 0 leaves the report and a failing rank its error


def split_stages(sizes: list[int], world: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of stages, one per rank, each non-empty, balanced by parameter count."""
    n = len(sizes)
    if world > n:
        raise UsageError(f"{OPTION}: {world} ranks for a model of {n} stages; use at most {n} devices.")
    total = float(sum(sizes)) or 1.0
    cuts, start = [], 0
    bounds = [0.0] + [float(s) for s in torch.tensor(sizes, dtype=torch.float64).cumsum(0).tolist()]
    for r in range(1, world):
        target = total * r / world
        # the cut nearest the target that leaves at least one stage to every rank before and after it
        lo, hi = start + 1, n - (world - r)
        best = min(range(lo, hi + 1), key=lambda c: (abs(bounds[c] - target), c))
        cuts.append(best)
        start = best
    edges = [0] + cuts + [n]
    return [(edges[i], edges[i + 1]) for i in range(world)]


def stage_sizes(names: list[str], modules: Callable[[str], list[tuple[str, Any]]]) -> list[int]:
    """Parameters per stage (read from the meta-device model: nothing is loaded)."""
    return [sum(p.numel() for _, m in modules(s) for p in m.parameters()) for s in names]


# --------------------------------------------------------------------------------------- states over send/recv


def _pack(state: dict[str, Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """A state as (a picklable description, its tensors in order)."""
    meta, tensors = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            meta.append((key, "t", (tuple(value.shape), value.dtype)))
            tensors.append(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            meta.append((key, "tuple", [(tuple(v.shape), v.dtype) for v in value]))
            tensors.extend(value)
        else:
            meta.append((key, "v", value))
    return meta, tensors


def _unpack(meta: list[Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    it = iter(tensors)
    for key, kind, value in meta:
        if kind == "t":
            out[key] = next(it)
        elif kind == "tuple":
            out[key] = tuple(next(it) for _ in value)
        else:
            out[key] = value
    return out


class Link:
    """send/recv between ranks on the backend's device (CPU for gloo, the rank's accelerator otherwise)."""

    def __init__(self, comm: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.comm = dist, comm

    def send_object(self, obj: Any, dst: int) -> None:
        self.dist.send_object_list([obj], dst=dst, device=self.comm)

    def recv_object(self, src: int) -> Any:
        box = [None]
        self.dist.recv_object_list(box, src=src, device=self.comm)
        return box[0]

    def send_tensors(self, meta: Any, tensors: list[torch.Tensor], dst: int) -> None:
        self.send_object(meta, dst)  # shapes and dtypes first
        for t in tensors:
            self.dist.send(t.detach().contiguous().to(self.comm), dst=dst)

    def recv_tensors(self, src: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        out = []
        for shape, dtype in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.comm)
            self.dist.recv(t, src=src)
            out.append(t)
        return out

    def send_states(self, states: list[dict[str, Any]], extra: Any, dst: int) -> None:
        packed = [_pack(s) for s in states]
        self.send_tensors(([m for m, _ in packed], extra), [t for _, ts in packed for t in ts], dst)

    def recv_states(self, src: int) -> tuple[list[dict[str, Any]], Any]:
        metas, extra = self.recv_object(src)
        shapes = []
        for meta in metas:
            for _, kind, value in meta:
                if kind == "t":
                    shapes.append(value)
                elif kind == "tuple":
                    shapes.extend(value)
        tensors = iter(self.recv_tensors(src, shapes))
        states = []
        for meta in metas:
            n = sum(1 if kind == "t" else len(value) for _, kind, value in meta if kind != "v")
            states.append(_unpack(meta, [next(tensors) for _ in range(n)]))
        return states, extra


def _to(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The same bits on `device` (where the run that owns the state computes)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device)
        elif isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            out[k] = tuple(t.to(device) for t in v)
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------------------------------------ a rank


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


def run_rank(job: Job, rank: int, world: int, device: str, progress: Progress) -> Any:
    """One rank's share of the pipeline; returns the Report on rank 0, None elsewhere."""
    from .checks import GoldenWeights, check_dequantized
    from .compare import Carry, Runs, lockstep_stages, start
    from .inputs import build_inputs
    from .runners.torch_staged import torch_runner
    from .verdict import DTYPES, RunFacts, verdict
    from .weights import WeightSource

    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif dev.type == "npu":
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
    comm = torch.device("cpu") if job.backend == "gloo" else dev
    link = Link(comm)
    run_dtype, gold_dtype = DTYPES[job.dtype], DTYPES[job.golden_dtype]
    progress.phase = "reading the weights"
    source = WeightSource(job.model, job.config)
    shapes = [(k, shape) for k, shape, _ in source.plan.outputs()]
    batch = len(job.seeds) * len(job.timesteps)
    ref = _reference_for(job, dev, source.config, shapes, batch, source.stage_of)
    golden_weights = GoldenWeights()
    intrinsic = (torch_runner(source, ref, run_dtype) if job.intrinsic == "native" else
                 torch_runner(source, ref, torch.float32, emulate=run_dtype))
    runs = Runs(torch_runner(source, ref, gold_dtype, golden_weights), intrinsic,
                torch_runner(source, dev, run_dtype, job.device_weight_transform))
    if job.prepare_device_model is not None:
        job.prepare_device_model(runs.device.model)
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
    counts = (golden_weights.seen, golden_weights.zero)
    if rank != 0:
        progress.phase = "sending its rows to rank 0"
        link.send_object((rows, here, counts), 0)
        if rank == world - 1:
            out = [carry.outputs()[k] for k in ("golden", "intrinsic", "device")]
            link.send_tensors([(tuple(t.shape), t.dtype) for t in out], out, 0)
        return None
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


# ------------------------------------------------------------------------------------- spawned on this host


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
           "validation.distributed"]


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



# --------------------------------------------------------------------------------------------- the entry point


def validate_pipeline(model: str | Path, *, devices: str | Sequence[str], dtype: str | None = None,
                      reference: str | None = None, golden_dtype: str | None = None, out: Path | None = None,
                      resolution: int = 512, text_len: int = 512, timesteps: Sequence[float] = (1.0, 0.5, 0.1),
                      seeds: Sequence[int] = (0,), base: Path | None = None, prompt: str | None = None,
                      max_ratio: float = 2.0, config: Path | None = None, intrinsic: str | None = None,
                      device_weight_transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                      prepare_device_model: Callable[[torch.nn.Module], None] | None = None) -> Any:
    """Check everything that can be checked before any process starts, then run the ranks (spawned here, or this
    process is one of torchrun's). Returns the Report on rank 0 and None on the other ranks under torchrun.

    `device_weight_transform` and `prepare_device_model` must be picklable (module-level functions or partials of
    them) to reach spawned ranks."""
    from porting.outputs import check_output
    from porting.resources import check_device_count, check_ranks_memory, check_validate_memory

    from .checks import check_not_one_computation
    from .memory import host_breakdown, host_need, request_for
    from .verdict import _dtype
    from .weights import WeightSource

    specs = parse_devices(devices)
    reference = reference or "devices"
    if reference not in ("cpu", "devices"):
        raise UsageError(f"--reference {reference!r} with {OPTION}: use cpu (every rank's golden on its host's CPU) or "
                         "devices (on each rank's own device when it has room, else on the CPU).")
    if intrinsic not in (None, "native", "emulated"):
        raise UsageError(f"--intrinsic {intrinsic!r}: use native or emulated.")
    intrinsic = intrinsic or ("emulated" if specs[0].type == "cpu" else "native")  # as validate's default_intrinsic
    dtype, golden_dtype = dtype or "bf16", golden_dtype or "fp32"
    run_dtype, gold_dtype = _dtype(dtype, "--dtype"), _dtype(golden_dtype, "--golden-dtype")
    if gold_dtype.itemsize <= run_dtype.itemsize and dtype != "fp32":
        raise PortError(f"--golden-dtype {golden_dtype} must be more precise than --dtype {dtype}.")
    kind = specs[0].type
    check_not_one_computation(dtype=dtype, golden_dtype=golden_dtype, device=kind,
                              reference=kind if reference == "devices" or kind == "cpu" else "cpu", runtime="torch")
    torchrun = launched_by_torchrun()
    rank = int(os.environ["RANK"]) if torchrun else 0
    read_paths = {"model": model, "--base": base, "--config": config}
    if out is not None and rank == 0:
        check_output(Path(out), verb="validate", replace="owned", inputs=read_paths)
    source = WeightSource(model, config)
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else len(specs)  # torchrun: every host's ranks
    check_device_count(OPTION, world_size, source.stage_count())  # before any rank starts (or joins)
    if reference == "cpu" or kind == "cpu":  # every rank of this host computes its golden on the host
        check_validate_memory(source.config, [(k, shape) for k, shape, _ in source.plan.outputs()],
                              resolution=resolution, text_len=text_len, batch=len(seeds) * len(timesteps),
                              golden_dtype=golden_dtype, dtype=dtype, text_encoders=source.text_encoders(base, prompt),
                              stage_of=source.stage_of, ranks=len(specs))
    else:  # each rank stages its stages' weights to its device and compares them through this host
        request = request_for(source, reference=kind, device=kind, resolution=resolution, text_len=text_len,
                              batch=len(seeds) * len(timesteps), golden_dtype=golden_dtype, dtype=dtype, base=base,
                              prompt=prompt)
        per_rank, terms = host_need(request)
        check_ranks_memory(OPTION, len(specs), per_rank, host_breakdown(request, terms))
    backend = check_backend(specs)  # the devices are probed after the host's estimate (docs/validate.md, "Memory")
    job = Job(model=str(model), devices=[str(s) for s in specs], backend=backend, dtype=dtype,
              golden_dtype=golden_dtype, reference=reference, out=str(out) if out is not None else None,
              resolution=resolution, text_len=text_len, timesteps=list(timesteps), seeds=list(seeds),
              base=str(base) if base is not None else None, prompt=prompt, max_ratio=max_ratio,
              config=str(config) if config is not None else None, intrinsic=intrinsic,
              read_paths={k: str(v) if v is not None else None for k, v in read_paths.items()},
              timeout_s=timeout_s(), device_weight_transform=device_weight_transform,
              prepare_device_model=prepare_device_model)
    if not torchrun:
        return spawn(job)
    world = int(os.environ["WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world != len(specs) or world % len(specs):
        raise UsageError(f"{OPTION} {','.join(job.devices)}: torchrun started {local_world} process(es) on this host "
                         f"({world} in all); {OPTION} names the devices of one host, one per process.",
                         hint=f"Launch with torchrun --nproc-per-node {len(specs)}.")
    return rank_main(job, rank, world, job.devices[local])
