"""The conversion plan: which source tensors become which target tensors, with shapes, before any data is read.

The strict check compares the plan against every tensor the target model has for the config (the family's
diffusers shape data, held against diffusers' meta-device model by the tests), so a plan is only accepted when every
source tensor is consumed exactly once and every target tensor is produced exactly once with the shape the model
expects.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Iterator

from porting.errors import MappingTableError
from porting.families.mapping import Naming, Step
from porting.families.ops import OpShapeError, Shape
from porting.inputs.detect import Detection
from porting.tensors.checkpoint import Checkpoint
from porting.tensors.dtypes import OPTION_TO_TAG, nbytes


@dataclass
class PlannedStep:
    step: Step
    stored_sources: tuple[str, ...]  # keys as stored in the checkpoint (prefix included)
    in_shapes: tuple[Shape, ...]
    out_shapes: tuple[Shape, ...]
    out_dtype: str


@dataclass
class Plan:
    detection: Detection
    source_naming: Naming
    target_naming: Naming
    steps: list[PlannedStep]
    target_shapes: dict[str, Shape]
    missing_sources: list[tuple[str, str | None]] = field(default_factory=list)
    unexpected: list[tuple[str, str | None]] = field(default_factory=list)
    missing_targets: list[str] = field(default_factory=list)
    extra_targets: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, Shape, Shape]] = field(default_factory=list)
    shape_errors: list[tuple[str, str]] = field(default_factory=list)
    produced_from: dict[str, tuple[str, ...]] = field(default_factory=dict)  # target -> source keys as stored

    @property
    def ok(self) -> bool:
        return not (self.missing_sources or self.unexpected or self.missing_targets or self.extra_targets
                    or self.mismatched or self.shape_errors)

    def outputs(self) -> Iterator[tuple[str, Shape, str]]:
        for ps in self.steps:
            for key, shape in zip(ps.step.targets, ps.out_shapes):
                yield key, shape, ps.out_dtype

    @property
    def output_bytes(self) -> int:
        return sum(nbytes(shape, dtype) for _, shape, dtype in self.outputs())

    @property
    def output_count(self) -> int:
        return sum(len(ps.step.targets) for ps in self.steps)

    def _source_of(self, target: str) -> str | None:
        """The user's key(s), in the checkpoint's own naming, that a target key is made from."""
        sources = self.produced_from.get(target)
        return ", ".join(sources) if sources else None

    def problems(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        rows += [{"kind": "missing source", "key": k, "closest": c} for k, c in self.missing_sources]
        rows += [{"kind": "unexpected source", "key": k, "closest": c} for k, c in self.unexpected]
        rows += [{"kind": "not produced", "key": k, "closest": None} for k in self.missing_targets]
        rows += [{"kind": "not in target model", "key": k, "source": self._source_of(k),
                  "closest": _closest(k, self.target_shapes)} for k in self.extra_targets]
        rows += [{"kind": "shape mismatch", "key": k, "source": self._source_of(k), "closest": None,
                  "produced": list(p), "expected": list(e)} for k, p, e in self.mismatched]
        rows += [{"kind": "shape error", "key": k, "closest": None, "message": m} for k, m in self.shape_errors]
        return rows

    def summary(self) -> dict[str, Any]:
        d = self.detection
        return {
            "table": d.table.name, "from": self.source_naming, "to": self.target_naming, "variant": d.variant,
            "source_tensors": sum(len(ps.stored_sources) for ps in self.steps) + len(self.unexpected),
            "target_tensors": self.output_count, "target_model_tensors": len(self.target_shapes),
            "parameters": sum(_numel(s) for _, s, _ in self.outputs()), "output_bytes": self.output_bytes,
            "ok": self.ok, "problems": self.problems(),
        }


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _closest(key: str, candidates) -> str | None:
    found = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return found[0] if found else None


def build_plan(ckpt: Checkpoint, detection: Detection, target: Naming, dtype: str | None = None) -> Plan:
    """Plan the conversion of `ckpt` into `target` naming; `dtype` is a safetensors tag or None to keep."""
    source = detection.naming
    family = detection.family
    sizes = family.sizes(detection.config)
    table = detection.table
    steps = table.identity(sizes, source) if source == target else table.expand(sizes, source)
    prefix = detection.prefix
    target_shapes = family.expected_shapes(detection.config, target)
    plan = Plan(detection, source, target, [], target_shapes)
    consumed: dict[str, int] = {}
    available = {k[len(prefix):]: k for k in ckpt.tensors if k.startswith(prefix)}
    for step in steps:
        missing = [s for s in step.sources if s not in available]
        if missing:
            for s in missing:
                plan.missing_sources.append((s, None))
            continue
        for s in step.sources:
            if s in consumed:
                raise MappingTableError(f"{detection.table.name}: source {s!r} is used by rules "
                                        f"{consumed[s] + 1} and {step.rule_index + 1}.")
            consumed[s] = step.rule_index
        infos = [ckpt.tensors[available[s]] for s in step.sources]
        try:
            out_shapes = tuple(step.op.shapes([i.shape for i in infos]))
        except OpShapeError as e:
            plan.shape_errors.append((", ".join(step.sources), str(e)))
            continue
        kinds = sorted({i.dtype for i in infos})
        if dtype is None and len(kinds) > 1:  # fusing them into the first one's dtype would silently round
            plan.shape_errors.append((", ".join(step.sources), f"parts of different dtypes ({', '.join(kinds)}) "
                                      "would be fused into one tensor; pass --dtype to choose the dtype"))
            continue
        out_dtype = dtype or infos[0].dtype
        plan.steps.append(PlannedStep(step, tuple(available[s] for s in step.sources),
                                      tuple(i.shape for i in infos), out_shapes, out_dtype))
    # steps in the order their sources are stored, so a conversion reads each source file front to back
    file_order = {f: i for i, f in enumerate(ckpt.files)}
    plan.steps.sort(key=lambda ps: (file_order.get(ckpt.tensors[ps.stored_sources[0]].file, 0),
                                    ckpt.tensors[ps.stored_sources[0]].start))
    leftovers = sorted(set(available) - set(consumed)) + sorted(k for k in ckpt.tensors if not k.startswith(prefix))
    plan.unexpected = [(k, _closest(k, [s for st in steps for s in st.sources])) for k in leftovers]
    plan.missing_sources = [(k, _closest(k, leftovers)) for k, _ in plan.missing_sources]
    produced = {}
    for ps in plan.steps:
        for key, shape in zip(ps.step.targets, ps.out_shapes):
            produced[key] = shape
            plan.produced_from[key] = ps.stored_sources
    plan.missing_targets = sorted(set(target_shapes) - set(produced))
    plan.extra_targets = sorted(set(produced) - set(target_shapes))
    plan.mismatched = [(k, s, target_shapes[k]) for k, s in produced.items()
                       if k in target_shapes and target_shapes[k] != s]
    return plan


def torch_dtype_tag(name: str) -> str | None:
    """`keep` -> None, else the safetensors tag for bf16 / fp16 / fp32."""
    if name not in OPTION_TO_TAG:
        raise ValueError(name)
    return OPTION_TO_TAG[name]


__all__ = ["Plan", "PlannedStep", "build_plan", "torch_dtype_tag"]
