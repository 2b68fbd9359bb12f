"""`port merge BASE ADAPTER[:STRENGTH]...`: add adapter deltas to a base checkpoint, one rule group at a time.

Every adapter key must land on a base tensor, with the base's shape, or nothing is written: the silent drop of
unmatched keys is the bug users meet elsewhere. Each delta is added to the weight in float32 (a LoRA as one
`addmm`: W += s * B @ A), adapter after adapter, and the sum is cast back to the base's dtype once. The output
is written by `port convert`'s engine (strict plan, shards, manifest), in the base's naming or, with
`to="diffusers"`, converted on the way.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from porting.engine.convert import ConvertResult, convert, iter_tensors
from porting.engine.detect import Detection, detect
from porting.engine.mapping import Naming, Step
from porting.engine.plan import Plan
from porting.errors import PlanError, UsageError
from porting.finite import check_number, check_tensor
from porting.tensors.checkpoint import ST_TO_TORCH, Checkpoint, open_checkpoint
from porting.tensors.writer import Segments
from porting.text import one_line

from .delta import Shape, delta, delta_shape, multiplier, read32
from .describe import variant_configs
from .effect import Effect
from .naming import Adapter, ModuleAdapter, read_adapter


class AdapterMismatchError(PlanError):
    """Adapter keys that land on no base tensor (or on one of another shape)."""


def parse_strength(text: str) -> tuple[Path, float]:
    """`file.safetensors:0.8` -> (file, 0.8); no `:NUMBER` suffix means strength 1."""
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            return Path(head), float(tail)
        except ValueError:
            pass
    return Path(text), 1.0


Contribution = tuple[Adapter, ModuleAdapter, float]


@dataclass
class _Group:
    """Adapter modules whose parameters one table step carries from the adapter's naming to the base's."""

    step: Step
    expected: dict[str, Shape]  # source parameter -> shape it must have
    parts: dict[str, list[Contribution]] = field(default_factory=dict)
    ready: dict[str, torch.Tensor] | None = None

    def compute(self) -> dict[str, torch.Tensor]:
        if self.ready is None:
            inputs = [_sum(self.parts.get(s, []), self.expected[s]) for s in self.step.sources]
            self.ready = dict(zip(self.step.targets, self.step.op.apply(inputs)))
        return self.ready


def _sum(contributions: list[Contribution], shape: Shape) -> torch.Tensor:
    total = None
    for adapter, m, strength in contributions:
        d = delta(adapter, m, strength)
        total = d if total is None else total.add_(d)
    return total if total is not None else torch.zeros(shape, dtype=torch.float32)


class Placement:
    """Where every adapter module lands on the base, checked from headers before any tensor is read."""

    def __init__(self, ckpt: Checkpoint, detection: Detection, adapters: list[tuple[Adapter, float]]):
        self.detection = detection
        prefix = detection.prefix
        self.base_shapes = {k[len(prefix):]: ckpt.tensors[k].shape for k in ckpt.tensors if k.startswith(prefix)}
        self.direct: dict[str, list[Contribution]] = {}
        self.via: dict[str, _Group] = {}
        self.leftovers: list[tuple[str, str]] = []
        self.effect = Effect()  # what each merged tensor's delta does to it (port inspect --base measures the same)
        for adapter, strength in adapters:
            self.leftovers += [(f"{adapter.path.name}: {k}", why) for k, why in adapter.unknown]
            if adapter.table.name != detection.table.name:
                self.leftovers.append((str(adapter.path), f"a {adapter.table.name} adapter, the base is "
                                                          f"{detection.table.name}"))
                continue
            self._place(adapter, strength)

    def _place(self, adapter: Adapter, strength: float) -> None:
        det = self.detection
        steps: dict[str, Step] = {}
        if adapter.naming != det.naming:
            steps = {s: step for step in det.table.expand(det.family.sizes(det.config), adapter.naming)
                     for s in step.sources}
        groups: dict[int, _Group] = {}
        for m in adapter.modules.values():
            where = f"{adapter.path.name}: {', '.join(sorted(m.keys.values()))}"
            got = delta_shape(adapter, m)
            if adapter.naming == det.naming:
                if m.param not in self.base_shapes:
                    self.leftovers.append((where, f"the base has no tensor {m.param!r} ({det.variant})"))
                elif self.base_shapes[m.param] != got:
                    self.leftovers.append((where, f"difference {list(got)} does not fit {m.param} "
                                                  f"{list(self.base_shapes[m.param])}"))
                else:
                    self.direct.setdefault(m.param, []).append((adapter, m, strength))
                continue
            step = steps.get(m.param)
            if step is None or any(t not in self.base_shapes for t in step.targets):
                self.leftovers.append((where, f"{m.param} is no tensor of this base ({det.variant}, "
                                              f"{det.naming} naming)"))
                continue
            expected = dict(zip(step.sources, step.op.inverse().shapes([self.base_shapes[t] for t in step.targets])))
            if expected[m.param] != got:
                self.leftovers.append((where, f"difference {list(got)} does not fit {m.param} "
                                              f"{list(expected[m.param])}"))
                continue
            key = id(step)
            group = groups.get(key) or self._group_for(step, expected)
            groups[key] = group
            group.parts.setdefault(m.param, []).append((adapter, m, strength))

    def _group_for(self, step: Step, expected: dict[str, Shape]) -> _Group:
        existing = self.via.get(step.targets[0])  # another adapter in the same naming already uses this step
        if existing is not None and existing.step.sources == step.sources:
            return existing
        group = _Group(step, expected)
        for t in step.targets:
            self.via[t] = group
        return group

    def __contains__(self, param: str) -> bool:
        return param in self.direct or param in self.via

    def names(self, param: str) -> str:
        """The adapters (file x strength) whose deltas land on `param`, for messages."""
        contributions = list(self.direct.get(param, []))
        if param in self.via:
            contributions += [c for cs in self.via[param].parts.values() for c in cs]
        seen = dict.fromkeys(f"{a.path.name} x{s:g}" for a, _, s in contributions)
        return ", ".join(seen) or "no adapter"

    def add_into(self, param: str, weight: torch.Tensor) -> None:
        """Add every delta that lands on `param` to its float32 weight, in place (each delta used once)."""
        for adapter, m, strength in self.direct.pop(param, []):
            if m.kind == "lora":  # W += s * B @ A in one BLAS call, no separate delta buffer
                weight.addmm_(read32(adapter, m, "up"), read32(adapter, m, "down"),
                              alpha=multiplier(adapter, m, strength))
            else:
                weight.add_(delta(adapter, m, strength))
        if param in self.via:
            weight.add_(self.via.pop(param).compute().pop(param))

    def tensors(self, ckpt: Checkpoint, plan: Plan) -> Iterator[torch.Tensor | Segments]:
        """`iter_tensors` with the deltas added: untouched rule groups still go file to file."""
        for ps in plan.steps:
            if not any(s in self for s in ps.step.sources):
                yield from iter_tensors(ckpt, replace(plan, steps=[ps]))
                continue
            inputs = []
            for param, stored in zip(ps.step.sources, ps.stored_sources):
                weight = ckpt.read(stored)
                if param in self:
                    dtype = weight.dtype
                    merged = weight.to(torch.float32, copy=True)  # the base weight is measured against the sum
                    names = self.names(param)
                    self.add_into(param, merged)
                    # the sum must be finite and fit the dtype it is written in (the base's, then the output's)
                    narrowest = min((dtype, ST_TO_TORCH[ps.out_dtype]), key=lambda d: torch.finfo(d).max)
                    check_tensor(merged, f"{stored} plus the delta of {names}", ckpt.path, into=narrowest,
                                 hint="Lower the adapter's strength, or merge into a bf16 / fp32 copy of the base.")
                    self.effect.observe(param, weight, merged=merged, adapters=names)
                    del weight  # peak memory: the float32 sum and its cast, not the read as well
                    weight = merged.to(dtype)  # one rounding to the base dtype
                    del merged
                inputs.append(weight)
            outputs = ps.step.op.apply(inputs)
            del inputs, weight
            while outputs:  # hand each tensor over; nothing of this group stays referenced here
                yield outputs.pop(0).to(ST_TO_TORCH[ps.out_dtype]).contiguous()


def mismatch_error(base: str | Path, leftovers: list[tuple[str, str]]) -> AdapterMismatchError:
    lines = [one_line(f"  {key}: {why}") for key, why in leftovers[:40]]
    if len(leftovers) > 40:
        lines.append(f"  ... and {len(leftovers) - 40} more (use --json for all)")
    return AdapterMismatchError(
        f"{base}: {len(leftovers)} adapter key group(s) land on no base tensor; nothing was written.",
        hint="Check that the adapter was trained for this base (klein-4B vs klein-9B?) and is a transformer "
             "adapter (text-encoder LoRA keys cannot be merged into a transformer).",
        details="\n".join(lines), report={"leftovers": [{"keys": k, "why": w} for k, w in leftovers]})


def skip_keys(adapter: Adapter, patterns: Sequence[str]) -> list[str]:
    """Drop from `adapter` every module with a stored key matching one of the glob `patterns`, and every unreadable
    key matching one; return the stored keys dropped (sorted)."""
    if not patterns:
        return []
    hit = lambda key: any(fnmatch.fnmatchcase(key, p) for p in patterns)  # noqa: E731
    skipped: list[str] = []
    for param, m in list(adapter.modules.items()):
        if any(hit(k) for k in m.keys.values()):
            skipped += m.keys.values()
            del adapter.modules[param]
    skipped += [k for k, _ in adapter.unknown if hit(k)]
    adapter.unknown = [(k, why) for k, why in adapter.unknown if not hit(k)]
    return sorted(skipped)


def adapter_width(adapter: Adapter) -> int | None:
    """The model width the adapter was trained at: the most common dimension of its full-size deltas."""
    dims = Counter(d for m in adapter.modules.values() for d in delta_shape(adapter, m))
    return dims.most_common(1)[0][0] if dims else None


def check_width(adapter: Adapter, detection: Detection, base: str | Path) -> None:
    """A LoRA made for another size of the model (a klein-4B LoRA on a klein-9B base) is refused up front with both
    widths, instead of one shape error per module."""
    base_width = detection.config.get("num_attention_heads", 0) * detection.config.get("attention_head_dim", 0)
    width = adapter_width(adapter)
    if not base_width or width is None or width == base_width:
        return
    made_for = [name for name, cfg in variant_configs(adapter.table.name).items()
                if cfg["num_attention_heads"] * cfg["attention_head_dim"] == width]
    raise AdapterMismatchError(
        f"{adapter.path}: this adapter is {width} wide" + (f" (made for {' / '.join(made_for)})" if made_for else "")
        + f"; the base {base} is {base_width} wide ({detection.variant}); nothing was written.",
        hint="Merge it into the base it was trained on, or use the adapter made for this base.")


def merge(base: str | Path, adapters: list[tuple[str | Path, float]], out: str | Path, to: Naming | None = None,
          max_shard_size: str | int | None = None, force: bool = False, dry_run: bool = False,
          on_start: Callable[[int], None] | None = None,
          on_bytes: Callable[[int], None] | None = None,
          on_notice: Callable[[str], None] | None = None, skip: Sequence[str] = ()) -> ConvertResult:
    """Merge `adapters` [(file, strength)] into `base`; write it in the base's naming, or `to`.

    `skip`: glob patterns of adapter keys to drop on purpose (a dev LoRA's `guidance_in.*` on a klein base); what
    they drop is listed in the result and the manifest, never silently.
    """
    for path, strength in adapters:
        check_number(float(strength), "strength", path)
    ckpt = open_checkpoint(base)
    detection = detect(ckpt)
    read = [(read_adapter(path), float(strength)) for path, strength in adapters]
    skipped = {str(a.path): skip_keys(a, skip) for a, _ in read}
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(k, pattern) for keys in skipped.values() for k in keys):
            raise UsageError(f"--skip {pattern!r}: matches no key of the adapters; nothing was written.",
                             hint="Patterns are globs on the keys as stored (see port inspect ADAPTER --json).")
    for adapter, _ in read:
        if adapter.table.name == detection.table.name:
            check_width(adapter, detection, base)
    placement = Placement(ckpt, detection, read)
    if placement.leftovers:
        raise mismatch_error(base, placement.leftovers)
    merged: list[dict[str, Any]] = [
        {"adapter": str(Path(a.path).resolve()), "strength": s, "format": a.format, "naming": a.naming,
         "modules": len(a.modules), "kinds": a.kinds, "skipped": skipped[str(a.path)]} for a, s in read]
    result = convert(base, out, to=to or detection.naming, strict=True, max_shard_size=max_shard_size,
                     dry_run=dry_run, force=force, on_start=on_start, on_bytes=on_bytes,
                     tensors=placement.tensors,
                     manifest_extra={"merged_adapters": merged, "adapter_effect": placement.effect.doc},
                     inputs={"adapter": [a.path for a, _ in read]}, on_notice=on_notice)
    result.extra["skipped"] = {path: keys for path, keys in skipped.items() if keys}
    if not dry_run:
        result.extra["adapter_effect"] = placement.effect.doc
    return result
