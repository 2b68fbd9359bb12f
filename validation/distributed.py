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

This file is the entry point; the jobs are `distributed_plan` (devices, backend, the job, the stage split),
`distributed_link` (the carry over send/recv), `distributed_rank` (one rank) and `distributed_spawn` (the ranks
spawned on this host).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting.errors import PortError, UsageError

from .distributed_plan import (
    OPTION,
    Job,
    RankFailed,
    check_backend,
    launched_by_torchrun,
    parse_devices,
    split_stages,
    timeout_s,
)
from .distributed_rank import rank_main
from .distributed_spawn import spawn

__all__ = ["Job", "RankFailed", "launched_by_torchrun", "parse_devices", "split_stages", "validate_pipeline"]


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
