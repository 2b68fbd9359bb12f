"""`port merge BASE ADAPTER[:STRENGTH]...`: add adapter deltas to a base checkpoint, one rule group at a time.

Every adapter key must land on a base tensor, with the base's shape, or nothing is written: the silent drop of
unmatched keys is the bug users meet elsewhere. Each delta is added to the weight in float32 (a LoRA as one
`addmm`: W += s * B @ A), adapter after adapter, and the sum is cast back to the base's dtype once. The output
is written by `port convert`'s engine (strict plan, shards, manifest), in the base's naming or, with
`to="diffusers"`, converted on the way.
"""

from __future__ import annotations

import fnmatch
import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from porting.engine.convert import ConvertResult, convert, iter_tensors
from porting.engine.plan import Plan, PlannedStep
from porting.errors import PlanError, UsageError
from porting.families.mapping import Naming, Step
from porting.finite import check_number, check_tensor
from porting.inputs import SourceLike, as_source, shown
from porting.inputs.adapter_keys import NOT_A_FACTOR, Adapter, ModuleAdapter
from porting.inputs.detect import Detection
from porting.tensors.checkpoint import ST_TO_TORCH, Checkpoint
from porting.tensors.dtypes import itemsize
from porting.tensors.reader import TensorInfo
from porting.tensors.writer import Filled, Segments
from porting.text import one_line

from .delta import Shape, delta, delta_shape, multiplier, read32
from .describe import variant_configs
from .effect import Effect, changed_bf16, effect_of, squares


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
        self.path = ckpt.path
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
        for d in self._deltas(param, self.pop(param)):
            weight.add_(d.whole())

    def pop(self, param: str) -> list[Contribution | _Group]:
        """What lands on `param`, in the order it is added; taken out (each delta is used once)."""
        return [*self.direct.pop(param, []), *([self.via.pop(param)] if param in self.via else [])]

    @staticmethod
    def _deltas(param: str, parts: list[Contribution | _Group]) -> list[_Delta]:
        return [_Delta(p, param) for p in parts]

    def tensors(self, ckpt: Checkpoint, plan: Plan) -> Iterator[torch.Tensor | Segments | Filled]:
        """`iter_tensors` with the deltas added: untouched rule groups still go file to file, and rule groups that
        only move rows (renames, splits, the final-layer swap) are merged a block of rows at a time, straight into
        the writer's buffers."""
        files = _Files()
        helper = ThreadPoolExecutor(HELPERS or _cores() - 1, thread_name_prefix="flux-port-merge",
                                    initializer=_one_thread) if (HELPERS or _cores() - 1) > 0 else None
        try:
            for ps in plan.steps:
                if not any(s in self for s in ps.step.sources):
                    yield from iter_tensors(ckpt, replace(plan, steps=[ps]))
                    continue
                infos = [ckpt.tensors[k] for k in ps.stored_sources]
                ranges = None
                if all(not i.computed and i.dtype == ps.out_dtype and i.shape and i.shape[0] for i in infos):
                    ranges = ps.step.op.byte_ranges([i.shape for i in infos], itemsize(ps.out_dtype))
                if ranges is None:
                    yield from self._whole(ckpt, ps)
                    continue
                rows = [_MergedRows(info, param, self, files, helper) if param in self else _StoredRows(info, files)
                        for param, info in zip(ps.step.sources, infos)]
                for parts in ranges:
                    yield _filled(rows, parts, ", ".join(ps.stored_sources))
                del rows  # every row of this group was written before the next group is asked for
        finally:
            files.close()
            if helper is not None:
                helper.shutdown()

    def _whole(self, ckpt: Checkpoint, ps: PlannedStep) -> Iterator[torch.Tensor]:
        """A rule group whose operation needs whole tensors, or whose dtype changes: merged in memory."""
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
                check_tensor(merged, f"{stored} plus the delta of {names}", ckpt.path, into=narrowest, hint=SUM_HINT)
                self.effect.observe(param, weight, merged=merged, adapters=names)
                del weight  # peak memory: the float32 sum and its cast, not the read as well
                weight = merged.to(dtype)  # one rounding to the base dtype
                del merged
            inputs.append(weight)
        outputs = ps.step.op.apply(inputs)
        del inputs, weight
        while outputs:  # hand each tensor over; nothing of this group stays referenced here
            yield outputs.pop(0).to(ST_TO_TORCH[ps.out_dtype]).contiguous()


SUM_HINT = "Lower the adapter's strength, or merge into a bf16 / fp32 copy of the base."
HELPERS = 0  # threads computing blocks beside the producer's (0: one per further core)
BLOCK_ELEMENTS = 2**20  # float32 values per block of the merge arithmetic (4 MiB): its passes stay in the cache


class _Delta:
    """One delta landing on a parameter, handed out a block of rows at a time.

    A LoRA is multiplied out per block (B[rows] @ A, then times the multiplier: the same float32 values as the whole
    product); other kinds (LoKr, LoHa, diff, and deltas carried through a table step) are computed whole, once.
    """

    def __init__(self, part: Contribution | _Group, param: str):
        self.part, self.param = part, param  # which adapter module (or table-step group) this delta comes from
        self.lora: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.full: torch.Tensor | None = None
        if isinstance(part, _Group):
            self.full = part.compute().pop(param)
            return
        adapter, m, strength = part
        if m.kind == "lora":
            up, down, s = read32(adapter, m, "up"), read32(adapter, m, "down"), multiplier(adapter, m, strength)
            if s != 1.0 and s != 0.0 and math.frexp(abs(s))[0] == 0.5:  # a power of two (alpha = rank / 2, ...):
                down, s = down * s, 1.0  # scaling the factor once is exact, and saves a pass over every block
            self.lora = (up, down, s)
            self.down_gram = (down @ down.T).double()  # r x r, once: the squared norm of a block comes from it
        else:
            self.full = delta(adapter, m, strength)

    def squares(self, a: int, b: int) -> float | None:
        """||delta[a:b]||_F^2 of a LoRA without a pass over the block: ||s B A||^2 = s^2 sum((B^T B) * (A A^T)), r x r
        (in float64); None for other kinds, or where float32 overflows (the caller sums the block's squares)."""
        if self.lora is None:
            return None
        up, _, s = self.lora
        rows = up[a:b]
        total = float(((rows.T @ rows).double() * self.down_gram).sum()) * s * s
        return total if math.isfinite(total) else None

    def rows(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """The float32 delta of rows [a, b): in `out` (a buffer of that shape) or a view of the whole delta."""
        if self.lora is None:
            assert self.full is not None
            return self.full[a:b]
        up, down, s = self.lora
        torch.matmul(up[a:b], down, out=out)
        if s != 1.0:
            out.mul_(s)
        return out

    def whole(self) -> torch.Tensor:
        if self.lora is None:
            assert self.full is not None
            return self.full
        up, down, _ = self.lora
        return self.rows(0, up.shape[0], torch.empty(up.shape[0], down.shape[1], dtype=torch.float32))


class _Files:
    """The source files' readers (files.reader_for: one descriptor per file, opened when its header was read) for
    positioned reads. Each range is read once, so its cached pages are dropped as soon as it is read: a base the size
    of the page cache would otherwise push out the pages of the output being written, and the kernel's reclaim of
    them doubled merge's system time (measured on klein-9B shapes: 17 s instead of 32-35 s of system time for a
    4.2 GB base)."""

    def __init__(self) -> None:
        self._readers: dict[Path, Any] = {}

    def read_into(self, view: memoryview, info: TensorInfo, offset: int) -> None:
        """Fill `view` with the bytes of `info` from byte `offset` of its data on."""
        reader = self._readers.get(info.file)
        if reader is None:
            from porting.tensors.files import reader_for

            reader = self._readers[info.file] = info.reader if info.reader is not None else reader_for(info.file)
            reader.advise(0, 0, "sequential")
        reader.read_into(view, info.start + offset, f"tensor {info.name!r}")
        reader.advise(info.start + offset, view.nbytes, "dontneed")

    def close(self) -> None:
        self._readers.clear()


class _StoredRows:
    """Rows of a base tensor no delta lands on (the other inputs of a rule group that has one), as stored."""

    def __init__(self, info: TensorInfo, files: _Files):
        self.info, self.files = info, files
        self.row_bytes = info.nbytes // info.shape[0]

    def write(self, view: memoryview, a: int, b: int) -> None:
        self.files.read_into(view, self.info, a * self.row_bytes)


class _MergedRows(_StoredRows):
    """Rows of a base tensor plus every delta that lands on it: the stored rows are read into the output buffer,
    then each block is summed in float32 (weight, then each delta in order), checked and rounded back in place."""

    def __init__(self, info: TensorInfo, param: str, placement: Placement, files: _Files,
                 helper: ThreadPoolExecutor | None):
        super().__init__(info, files)
        names = placement.names(param)
        self.what = f"{info.name} plus the delta of {names}"
        self.effect = placement.effect.blockwise(param, math.prod(info.shape), names)
        self.deltas = placement._deltas(param, placement.pop(param))
        self.limit = torch.finfo(info.torch_dtype).max
        self.inner = tuple(info.shape[1:])
        self.step = max(1, BLOCK_ELEMENTS // max(math.prod(self.inner), 1))
        self.path = placement.path
        self.helper = helper

    def write(self, view: memoryview, a: int, b: int) -> None:
        super().write(view, a, b)
        stored = torch.frombuffer(view, dtype=self.info.torch_dtype).view(b - a, *self.inner)
        blocks = [(i, min(i + self.step, b - a)) for i in range(0, b - a, self.step)]
        n = 1 + (self.helper._max_workers if self.helper is not None else 0)
        shares = [blocks[k::n] for k in range(n)]  # this thread takes the first share, the helpers the others
        others = [self.helper.submit(self._blocks, stored, a, share) for share in shares[1:] if share] \
            if self.helper is not None else []
        try:
            self._blocks(stored, a, shares[0])
        finally:
            for other in others:
                other.result()

    def _blocks(self, stored: torch.Tensor, a: int, blocks: list[tuple[int, int]]) -> None:
        for i, j in blocks:
            base = stored[i:j]
            weight = _buffer("weight", base.shape).copy_(base)  # widened exactly, once
            total: torch.Tensor | None = None
            d_sq: float | None = None
            for one in self.deltas:
                buf = _buffer("delta" if total is not None else "sum", base.shape)
                d = one.rows(a + i, a + j, buf)
                if total is None:  # the float32 sum starts as this delta plus the stored weight
                    if len(self.deltas) == 1:  # the effect's numbers of the delta, before the sum takes its buffer
                        d_sq = one.squares(a + i, a + j)
                        d_sq, lo, hi = effect_of(d, d_sq)
                    total = d.add_(weight) if d is buf else torch.add(d, weight, out=buf)
                else:
                    total.add_(d)
            assert total is not None
            if len(self.deltas) > 1:
                d_sq, lo, hi = effect_of(torch.sub(total, weight, out=_buffer("delta", base.shape)))
            assert d_sq is not None
            w_sq = squares(weight)
            before = _buffer("before", base.shape, base.dtype).copy_(base)
            base.copy_(total)  # one rounding to the base dtype, into the output buffer
            self.effect.block(d_sq, w_sq, max(-lo, hi), changed_bf16(before, base, total))
            # |W + d| <= ||W||_F + max |d| everywhere: far below the dtype's largest, the rounded block needs no look
            if not math.sqrt(w_sq) + abs(lo) + abs(hi) < self.limit / 2:  # NaN, Inf or near the largest
                lo, hi = torch.aminmax(base)
                if not max(-float(lo), float(hi)) < self.limit:  # the sum decides
                    check_tensor(total, self.what, self.path, into=self.info.torch_dtype, hint=SUM_HINT)


_buffers = threading.local()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _one_thread() -> None:
    """The helper computes its half of the blocks on one core: torch's own worker threads would spin against it."""
    torch.set_num_threads(1)


def _buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A scratch tensor of `shape` (float32 unless said), reused (grown when needed) across blocks and tensors of
    this thread."""
    size = math.prod(shape)
    name = f"{name}-{dtype}"
    flat = getattr(_buffers, name, None)
    if flat is None or flat.numel() < size:
        flat = torch.empty(size, dtype=dtype)
        setattr(_buffers, name, flat)
    return flat[:size].view(shape)


def _filled(rows: list[_StoredRows], parts: list[tuple[int, int, int]], key: str) -> Filled:
    """The output tensor made of `parts` ((input, byte offset, byte length) of whole rows) of the inputs `rows`."""
    row_bytes = rows[parts[0][0]].row_bytes
    spans = [(rows[i], off // row_bytes, n // row_bytes) for i, off, n in parts]

    def fill(view: memoryview, a: int, b: int) -> None:
        start = 0  # first output row of the current span
        for source, first, count in spans:
            lo, hi = max(a, start), min(b, start + count)
            if lo < hi:
                source.write(view[(lo - a) * row_bytes:(hi - a) * row_bytes], first + lo - start, first + hi - start)
            start += count

    return Filled(sum(n for _, _, n in spans), row_bytes, fill, key)


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
        roles = [role for role, k in m.keys.items() if hit(k)]
        if roles == ["alpha"]:  # `--skip '*.alpha'` drops the alphas (the factors then scale by 1), not the modules
            skipped.append(m.keys.pop("alpha"))
            m.alpha = None
        elif roles:
            skipped += m.keys.values()
            del adapter.modules[param]
    skipped += [k for k, _ in adapter.unknown if hit(k)]
    adapter.unknown = [(k, why) for k, why in adapter.unknown if not hit(k)]
    return sorted(skipped)


def adapter_width(adapter: Adapter, prefer: int | None = None) -> int | None:
    """The model width the adapter was trained at: the most common dimension of its full-size deltas; of several
    equally common ones (a LoRA on the fused qkv alone: 3 x width and width), `prefer` if it is one of them."""
    dims = Counter(d for m in adapter.modules.values() for d in delta_shape(adapter, m))
    if not dims:
        return None
    top = max(dims.values())
    return prefer if prefer is not None and dims.get(prefer) == top else dims.most_common(1)[0][0]


def check_width(adapter: Adapter, detection: Detection, base: str | Path) -> None:
    """A LoRA made for another size of the model (a klein-4B LoRA on a klein-9B base) is refused up front with both
    widths, instead of one shape error per module."""
    base_width = detection.config.get("num_attention_heads", 0) * detection.config.get("attention_head_dim", 0)
    width = adapter_width(adapter, prefer=base_width)
    if not base_width or width is None or width == base_width:
        return
    made_for = [name for name, cfg in variant_configs(adapter.table.name).items()
                if cfg["num_attention_heads"] * cfg["attention_head_dim"] == width]
    raise AdapterMismatchError(
        f"{adapter.path}: this adapter is {width} wide" + (f" (made for {' / '.join(made_for)})" if made_for else "")
        + f"; the base {base} is {base_width} wide ({detection.variant}); nothing was written.",
        hint="Merge it into the base it was trained on, or use the adapter made for this base.")


def merge(base: SourceLike, adapters: list[tuple[SourceLike, float]], out: str | Path, to: Naming | None = None,
          max_shard_size: str | int | None = None, force: bool = False, dry_run: bool = False,
          on_start: Callable[[int], None] | None = None,
          on_bytes: Callable[[int], None] | None = None,
          on_notice: Callable[[str], None] | None = None, skip: Sequence[str] = (),
          max_error: float | None = None, requantize: bool = False) -> ConvertResult:
    """Merge `adapters` [(file, strength)] into `base`; write it in the base's naming, or `to`. Each is a path or its
    opened `Source`; the base's is the one `Checkpoint` placement checks and the writer reads.

    `skip`: glob patterns of adapter keys to drop on purpose (a dev LoRA's `guidance_in.*` on a klein base); what
    they drop is listed in the result and the manifest, never silently. `max_error`, `requantize`: for a Nunchaku
    SVDQuant base (`svdq_merge.py`).
    """
    for path, strength in adapters:
        check_number(float(strength), "strength", shown(path))
    source = as_source(base, kind="weights")
    detection = source.detection
    ckpt = detection.ckpt
    read = [(as_source(a, kind="adapter").read_adapter(prefer=detection.table.name), float(strength))
            for a, strength in adapters]
    skipped = {str(a.path): skip_keys(a, skip) for a, _ in read}
    for pattern in skip:
        if not any(fnmatch.fnmatchcase(k, pattern) for keys in skipped.values() for k in keys):
            raise UsageError(f"--skip {pattern!r}: matches no key of the adapters; nothing was written.",
                             hint="Patterns are globs on the keys as stored (see port inspect ADAPTER --json).")
    for adapter, _ in read:
        if not adapter.modules and adapter.unknown and all(why.startswith(NOT_A_FACTOR) for _, why in adapter.unknown):
            raise UsageError(f"{adapter.path}: no key is an adapter factor (LoRA, LoKr, LoHa, diff): these are "
                             "weights, not an adapter; nothing was written.",
                             hint="port merge BASE ADAPTER...: the base comes first, then the LoRA / LyCORIS files.")
        if not adapter.modules and not adapter.unknown:  # unreadable keys are refused by placement, with reasons
            raise UsageError(f"{adapter.path}: no adapter module is left to merge"
                             + (" after --skip" if skipped[str(adapter.path)] else "") + "; the result would be a "
                             "copy of the base. Nothing was written.",
                             hint="Drop the adapter from the command, or skip less.")
        if adapter.table.name == detection.table.name:
            check_width(adapter, detection, shown(base))
    placement = Placement(ckpt, detection, read)
    if placement.leftovers:
        raise mismatch_error(shown(base), placement.leftovers)
    merged: list[dict[str, Any]] = [
        {"adapter": str(Path(a.path).resolve()), "strength": s, "format": a.format, "naming": a.naming,
         "modules": len(a.modules), "kinds": a.kinds, "skipped": skipped[str(a.path)]} for a, s in read]
    from porting.tensors.quant.svdq.reader import svdq_info

    from . import svdq_merge

    if svdq_info(ckpt) is not None:
        return svdq_merge.merge_svdq(source, read, placement, lambda part, key: _Delta(part, key).whole(), merged, out,
                                     to=to, max_shard_size=max_shard_size,
                                     force=force, dry_run=dry_run, max_error=max_error, requantize=requantize,
                                     on_start=on_start, on_bytes=on_bytes)
    if requantize or max_error is not None:
        raise UsageError(f"{'--requantize' if requantize else '--max-error'} applies to Nunchaku SVDQuant bases; "
                         f"{shown(base)} is not one.", hint="Leave the option out.")
    result = convert(source, out, to=to or detection.naming, strict=True, max_shard_size=max_shard_size,
                     dry_run=dry_run, force=force, on_start=on_start, on_bytes=on_bytes,
                     tensors=placement.tensors,
                     manifest_extra={"merged_adapters": merged, "adapter_effect": placement.effect.doc},
                     inputs={"adapter": [a.path for a, _ in read]}, on_notice=on_notice)
    result.extra["skipped"] = {path: keys for path, keys in skipped.items() if keys}
    if not dry_run:
        result.extra["adapter_effect"] = placement.effect.doc
    return result
