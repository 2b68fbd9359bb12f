"""`port convert ADAPTER --out DIR`: an adapter rewritten for diffusers / peft, or in original (BFL or kohya) keys.

The diffusers file is what `pipe.load_lora_weights(DIR)` and `transformer.load_lora_adapter(FILE,
prefix="transformer")` load with no key left out: peft names under `transformer.`, the scale folded into one
factor (no alphas), fused projections split the way `transform` proves exact. diffusers loads LoRA and LoKr only
(one kind per file); LoHa, full differences and unsplittable LoKr factors are refused unless `materialise` asks
for their exact delta (as a full-rank LoRA for diffusers, as `.diff` for original naming).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from safetensors.torch import save_file

from porting import __version__
from porting.errors import InternalError, PortError
from porting.families import family_for
from porting.families.mapping import MappingTable, Naming
from porting.finite import check_tensor, dumps
from porting.inputs import SourceLike, as_source, shown
from porting.inputs.adapter_keys import Adapter, naming_config
from porting.outputs import InputPaths, atomic_folder
from porting.text import one_line

from . import LORA_FILE, MANIFEST
from .architecture import check_architecture, check_config
from .transform import Factors, NotSplittable, as_full_rank_lora, baked, carry, materialised, unsized

Style = Literal["diffusers", "bfl", "kohya"]

ROLE_KEYS = {
    "lora": {"down": "lora_A.weight", "up": "lora_B.weight"},
    "lokr": {r: f"lokr_{r}" for r in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")},
    "loha": {r: f"hada_{r}" for r in ("w1_a", "w1_b", "w2_a", "w2_b")},
    "diff": {"diff": "diff", "diff_b": "diff_b"},
}
KOHYA_LORA = {"down": "lora_down.weight", "up": "lora_up.weight"}


def output_name(source: Path, style: Style) -> str:
    """The converted file's name: diffusers' fixed name for diffusers naming; otherwise the source file's name,
    unless that name says diffusers (`pytorch_lora_weights.safetensors`, or a folder holding it): then one that
    names the naming written (`pytorch_lora_weights_kohya.safetensors`, `adapter_bfl.safetensors`)."""
    if style == "diffusers":
        return LORA_FILE
    if source.is_file() and source.name != LORA_FILE:
        return source.name
    stem = Path(LORA_FILE).stem if source.name == LORA_FILE or (source / LORA_FILE).is_file() else "adapter"
    return f"{stem}_{style}.safetensors"


@dataclass
class AdapterConvertResult:
    source: Path
    source_format: str
    source_naming: Naming
    to: Naming
    style: Style
    modules_in: int
    factors: list[Factors]
    materialised: list[str] = field(default_factory=list)
    out: Path | None = None
    file: str | None = None
    sha256: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for f in self.factors:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        return {"kind": "adapter", "source": str(self.source), "format": self.source_format,
                "from": self.source_naming, "to": self.to, "style": self.style, "modules_in": self.modules_in,
                "modules_out": len(self.factors), "kinds": dict(sorted(kinds.items())),
                "materialised": self.materialised, "out": str(self.out) if self.out else None, "file": self.file,
                "sha256": self.sha256, "seconds": round(self.seconds, 3)}


def carried(adapter: Adapter, to: Naming, materialise: bool = False, config: Mapping[str, Any] | None = None,
            done: list[str] | None = None) -> list[Factors]:
    """The adapter's modules in `to` naming (scale folded, float32); `done` collects materialised modules."""
    done = done if done is not None else []
    factors = {m.param: baked(adapter, m) for m in adapter.modules.values()}
    if adapter.naming == to:
        return list(factors.values())
    table = adapter.table
    steps = table.expand(family_for(table).sizes(config) if config else naming_config(table), adapter.naming)
    by_source = {s: step for step in steps for s in step.sources}
    out: list[Factors] = []
    seen: set[int] = set()
    for param in factors:
        step = by_source.get(param)
        if step is None:
            raise PortError(f"{adapter.path}: {param} is no module of this base (config given with --config).")
        if id(step) in seen:
            continue
        seen.add(id(step))
        op = step.op if config else unsized(table, step)
        if op is None:
            raise PortError(f"{adapter.path}: {param}: the table splits it into unequal parts, which only the "
                            "base's config can size.", hint="Pass --config BASE (a diffusers folder or config.json).")
        sources = [factors.get(s) for s in step.sources]
        try:
            out += [f for f in carry(step, op, sources) if f is not None]
        except NotSplittable:
            if not materialise:
                raise
            done += [f.param for f in sources if f is not None and f.kind != "diff"]
            out += [f for f in carry(step, op, [materialised(f) if f else None for f in sources]) if f is not None]
    return out


def loadable_by_diffusers(factors: list[Factors], materialise: bool, done: list[str], path: Path) -> list[Factors]:
    """One kind per file, LoRA or LoKr; the rest as exact full-rank LoRAs when `materialise`."""
    kinds = {f.kind for f in factors}
    if kinds <= {"lora"} or kinds == {"lokr"}:
        return factors
    keep = "lora"
    if not materialise:
        why = ("diffusers loads LoRA and LoKr adapters only" if kinds - {"lora", "lokr"}
               else "diffusers loads one adapter kind per file (this one mixes LoRA and LoKr)")
        raise PortError(f"{path}: cannot write {'/'.join(sorted(kinds))} modules for diffusers: {why}.",
                        hint="Pass --materialise to write their exact deltas as full-rank LoRAs (large), use "
                             "--to original for ComfyUI, or bake the adapter in with port merge.")
    out = []
    for f in factors:
        if f.kind != keep:
            done.append(f.param)
            f = as_full_rank_lora(materialised(f))
        out.append(f)
    return out


def key_tensors(f: Factors, style: Style) -> dict[str, torch.Tensor]:
    """The stored keys of one module in `style`."""
    if style == "kohya":
        head = "lora_unet_" + f.module.replace(".", "_") + "."
        roles = KOHYA_LORA if f.kind == "lora" else ROLE_KEYS[f.kind]
    else:
        head = ("transformer." if style == "diffusers" else "diffusion_model.") + f.module + "."
        roles = ROLE_KEYS[f.kind]
    out = {head + roles[role]: t for role, t in f.t.items()}
    if style == "kohya" and f.kind == "lora":
        out[head + "alpha"] = torch.tensor(float(f.rank))  # alpha = rank: scale 1, already folded in
    return out


def convert_adapter(src: SourceLike, out: str | Path | None, to: Naming = "diffusers", style: Style | None = None,
                    materialise: bool = False, config: Mapping[str, Any] | None = None,
                    force: bool = False, table: MappingTable | None = None,
                    inputs: InputPaths | None = None) -> AdapterConvertResult:
    """Rewrite the adapter at `src` (a path, or its opened `Source`) for `to` naming; `table` replaces the built-in
    mapping table of its family.

    `inputs` names further paths the caller read (the --config file), which `out` must keep clear of, as of `src`.
    """
    started = time.perf_counter()
    adapter = as_source(src, kind="adapter").read_adapter(table)
    if adapter.unknown:
        lines = "\n".join(one_line(f"  {k}: {why}") for k, why in adapter.unknown[:40])
        raise PortError(f"{shown(src)}: {len(adapter.unknown)} adapter key(s) cannot be read; nothing was written.",
                        hint="flux-port reads kohya, BFL / ai-toolkit, diffusers / peft, LyCORIS and ComfyUI diff "
                             "keys of transformer modules.", details=lines)
    if config is None:  # no base to hold the shapes against: the family's architecture
        check_architecture(adapter)
    else:
        check_config(adapter, config)
    style = style or ("diffusers" if to == "diffusers" else "bfl")
    if (to == "diffusers") != (style == "diffusers"):
        raise PortError(f"key style {style!r} does not go with --to {to}.",
                        hint="diffusers naming is written in diffusers style; kohya and bfl styles are original.")
    done: list[str] = []
    factors = carried(adapter, to, materialise, config, done)
    if to == "diffusers":
        factors = loadable_by_diffusers(factors, materialise, done, adapter.path)
    result = AdapterConvertResult(adapter.path, adapter.format, adapter.naming, to, style, len(adapter.modules),
                                  factors, sorted(set(done)))
    if out is None:
        result.seconds = time.perf_counter() - started
        return result
    factor_keys = [k for m in adapter.modules.values() for r, k in m.keys.items() if r != "alpha"]
    dtype = adapter.ckpt.tensors[factor_keys[0]].torch_dtype if factor_keys else torch.float32  # not the alphas'
    if dtype.itemsize == 1:  # fp8 factors: written bf16 (exact for their values; a folded scale is rounded once,
        dtype = torch.bfloat16  # and peft / diffusers load bf16 adapters)
    tensors: dict[str, torch.Tensor] = {}
    for f in factors:
        for key, t in key_tensors(f, style).items():
            if key in tensors:
                raise InternalError(f"{key} written twice.")
            check_tensor(t, f"{key} (from {f.param}, scale folded in)", adapter.path, into=dtype,
                         hint="The folded scale (alpha / rank) pushes the factor beyond the adapter's dtype; "
                              "convert a float32 copy of the adapter.")
            tensors[key] = t.to(dtype).contiguous()
    name = output_name(adapter.path, style)
    out = Path(out)
    with atomic_folder(out, force=force, verb="convert", inputs={"adapter": adapter.path, **(inputs or {})}) as staging:
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        digest = hashlib.sha256((staging / name).read_bytes()).hexdigest()
        manifest = {"tool": "flux-port", "version": __version__, **result.to_dict(), "out": None, "file": name,
                    "sha256": digest, "table": adapter.table.name}
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    result.out, result.file, result.sha256 = out, name, digest
    result.seconds = time.perf_counter() - started
    return result
