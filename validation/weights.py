"""Diffusers-named tensors from any supported checkpoint, one at a time.

An original-naming file is converted on the fly through the same mapping tables `port convert` uses, so a
fine-tune can be validated before it is converted on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from porting.engine.plan import Plan, build_plan
from porting.errors import InputError
from porting.families.stages import TransformerStages
from porting.inputs import Source, SourceLike, as_source
from porting.inputs.detect import Detection, load_base_config
from porting.tensors.checkpoint import Checkpoint, hash_checkpoint

WeightTransform = Callable[[str, torch.Tensor], torch.Tensor]


class WeightSource:
    def __init__(self, src: SourceLike, config: str | Path | None = None) -> None:
        """`src`: a path, or its opened `Source`; `config`: the base config the weights must fit."""
        source = as_source(src, kind="weights")
        self.source: Source = as_source(source, base_config=load_base_config(config)) if config else source
        self.path = path = self.source.path
        self.detection: Detection = self.source.detection
        self.ckpt: Checkpoint = self.detection.ckpt
        family = self.detection.family
        if not family.has_stages:
            raise InputError(f"{path}: port validate has no staged runner for {family.title or family.name} "
                             f"transformers ({self.detection.variant}): the family declares no stages.",
                             hint=f"{family.title or family.name} is convert-only in this flux-port: port convert "
                                  "works, port validate does not.")
        self.plan: Plan = build_plan(self.ckpt, self.detection, "diffusers")
        if not self.plan.ok:
            raise InputError(f"{path}: the checkpoint does not map cleanly onto {self.detection.table.diffusers_class} "
                             f"({len(self.plan.problems())} problem(s)).",
                             hint=f"Run `port convert {path} --dry-run --strict` to see them.")
        self._where: dict[str, tuple[int, int]] = {}
        for i, ps in enumerate(self.plan.steps):
            for j, key in enumerate(ps.step.targets):
                self._where[key] = (i, j)
        self._cached: tuple[int, list[torch.Tensor]] | None = None
        self._blocks = list(self.detection.table.block_patterns("diffusers").values())

    @property
    def config(self) -> dict[str, Any]:
        return self.detection.config

    @property
    def stages(self) -> TransformerStages:
        """The family's stages and input builders."""
        return self.detection.family.stages()

    def stage_of(self, key: str) -> str:
        """The block a diffusers key belongs to (`transformer_blocks.3`), or `other` (embeddings, output), through
        the mapping table's block templates: for memory estimates made before any model exists."""
        for pattern in self._blocks:
            m = pattern.match(key)
            if m:
                return m.group(0).rstrip(".")
        return "other"

    def stage_count(self) -> int:
        """The pipeline stages the staged runner makes of these weights: one per block, plus embed and final."""
        return len({self.stage_of(k) for k in self.keys()} - {"other"}) + 2

    def text_encoders(self, base: Path | None, prompt: str | None) -> list[Path]:
        """The base's text encoder folders a --prompt is encoded with (none without a prompt)."""
        if base is None or not prompt:
            return []
        return [Path(base) / name for name in self.stages.text_encoders]

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, key: str) -> torch.Tensor:
        """The tensor `key` (diffusers naming) in its stored dtype."""
        if key not in self._where:
            raise KeyError(key)
        i, j = self._where[key]
        if self._cached is None or self._cached[0] != i:
            ps = self.plan.steps[i]
            # keep one step's outputs: a fused qkv is read once for its three targets
            self._cached = (i, ps.step.op.apply([self.ckpt.read(k) for k in ps.stored_sources]))
        return self._cached[1][j]

    def provenance(self) -> dict[str, Any]:
        """Where the weights come from when they are not stored plainly: `dequantized_from` and its details.

        For a quantized file, every run (golden included) sees the dequantized weights in float32.
        """
        quant = self.ckpt.quantization
        if quant is None:
            manifest = self.path / "flux-port.json" if self.path.is_dir() else None
            if manifest is not None and manifest.is_file():
                from porting._files import parse_json
                from porting.errors import InputError

                try:
                    converted = parse_json(manifest.read_bytes(), str(manifest), kind=dict)
                except (OSError, InputError):
                    return {}
                if converted.get("dequantized_from"):
                    return {"dequantized_from": converted["dequantized_from"]}
            return {}
        return {"dequantized_from": quant.label, "quantization": quant.to_dict()}

    def weights_sha256(self) -> str:
        """Identity of the weights as `port convert` records it (diffusers naming)."""
        if self.detection.naming == "diffusers":
            return hash_checkpoint(self.ckpt, self.detection.prefix)
        from porting.tensors.identity import WeightsHasher

        hasher = WeightsHasher()
        for key, _, dtype in self.plan.outputs():
            hasher.update(key, self.get(key).contiguous(), dtype)
        return hasher.hexdigest()
