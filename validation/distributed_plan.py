"""Planning a multi-device validation: the device list, its torch.distributed backend, the job every rank receives
and the split of the model's stages over the ranks (validation/distributed.py runs it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from porting.devices import DeviceSpec, parse_device, resolve_device
from porting.errors import EXIT_CHECK_FAILED, DeviceError, PortError, UsageError

if TYPE_CHECKING:  # imported where used: `--devices` is checked (parse_devices) before torch is loaded
    import torch

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
    import torch
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
    import torch

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

