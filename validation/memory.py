"""The memory a `port validate` run holds, on the host and on each accelerator it uses, decided before any work.

With the CPU reference the golden lives in host memory (`porting.resources.check_validate_memory`). With the
reference on an accelerator (`--reference cuda|npu`) the golden's stage and activations live on the device, yet the
host still holds: every weight as it is read and staged on its way to the device (one plan step at a time, read and
made at most float32, and the tensor cast to the golden's dtype before the copy), the device under test when it is
the CPU (`--device cpu`: its stage and activations), the float64 copies the metrics compare, the inputs built on
CPU generators, the text encoders with `--prompt`, and the accelerator runtime's own host side.

`MemoryRequest` holds what the estimate is made from (the run's options, the config, the weights' shapes from the
headers), and `check_host` / `check_device` decide from it and the memory available: pure, so the refusal is
tested on a machine without any accelerator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from porting.resources import (
    MEMORY_OVERHEAD,
    check_validate_memory,
    gib,
    hidden_size,
    image_tokens,
    itemsize,
    require_memory,
    size_field,
    stage_params,
)

# the accelerator runtime's host side: the CUDA driver and context or CANN's runtime, their kernel images and pools
RUNTIME_HOST_BYTES = 2**30
# float64 copies of one judged tensor alive while a stage is compared: the residual and the golden update kept, the
# candidate's update, and compare()'s candidate, golden, difference, relative error and their temporaries
METRIC_COPIES = 8
# the device under test's own copies of the residual stream: its accumulated and teacher-forced states, and attention
# q/k/v and the MLP's projections of the pass in flight
DEVICE_RUN_COPIES = 12
INPUT_COPIES = 2  # the inputs are drawn per case and concatenated: two float32 copies while the batch is built

Shape = tuple[int, ...]
CPU_HINT = "Lower --resolution, --text-len or the number of --seeds / --timesteps"
SIZES_LOWER = "a lower --resolution or --text-len, or fewer --seeds / --timesteps"


@dataclass(frozen=True)
class MemoryRequest:
    """What one validate run asks for, as the estimate sees it (no I/O: every size is given)."""

    config: Mapping[str, Any]
    shapes: Sequence[tuple[str, Shape]]  # the weights in diffusers naming, from the headers
    reference: str  # device kind of the golden and the intrinsic run: cpu, cuda, npu, ...
    device: str | None  # device kind under test; None for an onnxruntime graph
    resolution: int
    text_len: int
    batch: int  # seeds x timesteps
    golden_dtype: str
    dtype: str
    step_params: int = 0  # parameters of the largest plan step (its targets are made together); 0: largest tensor
    encoder_bytes: int = 0  # text encoders in float32 (with --prompt)
    session_bytes: int = 0  # an onnxruntime session on the CPU: its graph and weights, as stored
    stage_of: Callable[[str], str] | None = field(default=None, compare=False)

    @property
    def tokens(self) -> int:
        return image_tokens(self.resolution, self.resolution) + self.text_len

    @property
    def sizes(self) -> str:
        return (f"--resolution {self.resolution} --text-len {self.text_len}, {self.batch} case(s) "
                f"(--seeds x --timesteps)")


@dataclass(frozen=True)
class Term:
    """One part of the host's need: its bytes, how it is made up, and the option that lowers it."""

    name: str
    bytes: int
    detail: str
    lower: str


def _stream(req: MemoryRequest, copies: int, nbytes: int) -> int:
    """`copies` copies of the residual stream (batch x tokens x hidden) with `nbytes`-byte elements."""
    return copies * req.batch * req.tokens * hidden_size(req.config) * nbytes


def host_terms(req: MemoryRequest) -> list[Term]:
    """The host's share of a run whose reference is an accelerator, largest parts named with what lowers them."""
    largest_tensor = max((math.prod(shape) for _, shape in req.shapes), default=0)
    step = max(req.step_params, largest_tensor)
    staging = 2 * 4 * step + itemsize(req.golden_dtype) * largest_tensor
    staging_lower = ("--golden-dtype fp32 (an fp64 golden stages every weight at 8 bytes)"
                     if req.golden_dtype == "fp64" else
                     "no option: the weights pass one tensor at a time; free memory or use a larger host")
    terms = [Term("staging", staging, f"weights staged to the {req.reference} one plan step at a time "
                  f"({step / 1e6:.1f} M parameters read and made in float32, the largest tensor cast to "
                  f"{req.golden_dtype}) {gib(staging)}", staging_lower)]
    if req.session_bytes:
        terms.append(_session_term(req))
    if req.device == "cpu":
        biggest = stage_params(req.shapes, req.stage_of)
        candidate = (biggest * (itemsize(req.dtype) + 4)
                     + _stream(req, DEVICE_RUN_COPIES, max(itemsize(req.dtype), 4)))
        terms.append(Term("candidate", candidate, f"the device under test on the cpu (largest stage "
                          f"{biggest / 1e6:.1f} M parameters in {req.dtype}, its activations) {gib(candidate)}",
                          f"--device {req.reference} (the device under test on the accelerator), or a lower "
                          "--resolution / --text-len"))
    compared = _stream(req, METRIC_COPIES, 8)
    terms.append(Term("compare", compared, f"float64 copies compared per stage ({req.batch} case(s) x "
                      f"{req.tokens:,} tokens x hidden {hidden_size(req.config)}) {gib(compared)}",
                      SIZES_LOWER))
    per_case = (image_tokens(req.resolution, req.resolution) * size_field(req.config, "in_channels")
                + req.text_len * size_field(req.config, "joint_attention_dim"))
    inputs = INPUT_COPIES * req.batch * per_case * 4
    terms.append(Term("inputs", inputs, f"inputs built on the host {gib(inputs)}",
                      SIZES_LOWER))
    if req.encoder_bytes:
        terms.append(Term("encoders", req.encoder_bytes, f"text encoder(s) in float32 {gib(req.encoder_bytes)}",
                          "no --prompt (synthetic text features)"))
    return terms


def _session_term(req: MemoryRequest) -> Term:
    held = req.session_bytes + _stream(req, DEVICE_RUN_COPIES, max(itemsize(req.dtype), 4))
    return Term("candidate", held, f"the onnxruntime session on the cpu (graph and weights {gib(req.session_bytes)}, "
                f"its activations) {gib(held)}", "--provider CUDAExecutionProvider or CANNExecutionProvider (the "
                "graph on the accelerator), or a lower --resolution / --text-len")


def host_need(req: MemoryRequest) -> tuple[int, list[Term]]:
    """Bytes of host memory a run with an accelerator reference holds at its peak, and its parts. The text encoders
    run (and are dropped) before any stage, so they count against the stages, not with them."""
    terms = host_terms(req)
    run = sum(t.bytes for t in terms if t.name != "encoders")
    encoders = sum(t.bytes for t in terms if t.name == "encoders")
    return MEMORY_OVERHEAD + RUNTIME_HOST_BYTES + max(run, encoders), terms


def host_breakdown(req: MemoryRequest, terms: Sequence[Term]) -> str:
    return ", ".join(t.detail for t in terms) + (f", {req.reference} runtime {gib(RUNTIME_HOST_BYTES)}, "
                                                 f"interpreter {gib(MEMORY_OVERHEAD)}")


def check_host(req: MemoryRequest, *, available: int | None = None) -> int:
    """Refuse (exit 2, before any model is built or any device probed) a run whose host share does not fit
    `available` bytes (default: what psutil says is available); returns the need. The hint names the option that
    lowers the largest part."""
    if req.reference == "cpu":
        session = _session_term(req) if req.session_bytes else None
        return check_validate_memory(req.config, req.shapes, resolution=req.resolution, text_len=req.text_len,
                                     batch=req.batch, golden_dtype=req.golden_dtype, dtype=req.dtype,
                                     available=available, stage_of=req.stage_of, encoders=req.encoder_bytes,
                                     candidate=(session.bytes, session.detail) if session else None,
                                     hint=f"{CPU_HINT}; or {session.lower}." if session else None)
    need, terms = host_need(req)
    ranked = sorted(terms, key=lambda t: -t.bytes)
    return require_memory(f"validating with the golden on {req.reference} at {req.sizes}: the host", need,
                          host_breakdown(req, terms), available=available,
                          hint=f"The largest part is {ranked[0].name}: {ranked[0].lower}. Or run on a host with "
                               "more memory.")


def device_run_need(req: MemoryRequest) -> tuple[int, str]:
    """An accelerator that runs only the device under test: the largest stage in --dtype and its activations."""
    biggest = stage_params(req.shapes, req.stage_of)
    weights = biggest * itemsize(req.dtype)
    acts = _stream(req, DEVICE_RUN_COPIES, itemsize(req.dtype))
    return MEMORY_OVERHEAD + weights + acts, (f"largest stage {biggest / 1e6:.1f} M parameters in {req.dtype} "
                                              f"{gib(weights)}, activations {gib(acts)}, runtime "
                                              f"{gib(MEMORY_OVERHEAD)}")


def check_device(req: MemoryRequest, where: str, *, golden: bool, free: int) -> int:
    """Refuse (exit 2, before any model is built) a run that does not fit the `free` bytes of accelerator `where`:
    with `golden`, the golden's stage and activations (the estimate `--devices` uses to place a rank's golden), else
    the device under test's own."""
    hint = CPU_HINT + ("; or --reference cpu (the golden in host memory)" if golden else "") + "."
    if golden:
        return check_validate_memory(req.config, req.shapes, resolution=req.resolution, text_len=req.text_len,
                                     batch=req.batch, golden_dtype=req.golden_dtype, dtype=req.dtype,
                                     available=free, stage_of=req.stage_of, where=f"on {where}", hint=hint)
    need, breakdown = device_run_need(req)
    return require_memory(f"running --dtype {req.dtype} on {where} at {req.sizes}", need, breakdown,
                          available=free, hint=hint)


def request_for(source: Any, *, reference: str, device: str | None, resolution: int, text_len: int, batch: int,
                golden_dtype: str, dtype: str, base: Any = None, prompt: str | None = None,
                session: Path | None = None) -> MemoryRequest:
    """The request of a run on `source` (a `validation.weights.WeightSource`): its config, the shapes and plan
    steps from the headers, the text encoders' size when they encode --prompt, and `session`, the graph file an
    onnxruntime CPU session opens (its size and its external data's: `<graph>.data`)."""
    from porting.resources import encoder_bytes

    steps = (sum(math.prod(shape) for shape in ps.out_shapes) for ps in source.plan.steps)
    return MemoryRequest(source.config, [(k, shape) for k, shape, _ in source.plan.outputs()], reference, device,
                         resolution, text_len, batch, golden_dtype, dtype, step_params=max(steps, default=0),
                         encoder_bytes=encoder_bytes(source.text_encoders(base, prompt)),
                         session_bytes=graph_bytes(session) if session is not None else 0,
                         stage_of=source.stage_of)


def graph_bytes(graph: Path) -> int:
    """An ONNX graph's bytes and its external data's (`model.onnx.data` beside `model.onnx`), as stored."""
    return sum(p.stat().st_size for p in (graph, graph.with_name(graph.name + ".data")) if p.is_file())


def check_devices(req: MemoryRequest, reference: Any, device: Any) -> None:
    """The free memory of each accelerator the run uses (torch.devices, present: resolve_device first), where its
    backend can say: the golden's on the reference, the device under test's on another accelerator."""
    from porting.devices import free_memory

    places = [(reference, True)] + ([(device, False)] if device is not None and device != reference else [])
    for place, golden in places:
        if place.type == "cpu":
            continue
        free = free_memory(place)
        if free is not None:
            check_device(req, str(place), golden=golden, free=free)
