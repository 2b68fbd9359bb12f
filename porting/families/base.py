"""What a model family is: its mapping table (data in `mappings/`) plus what a table cannot say.

A family knows how to turn facts read off shapes into a diffusers config, which sizes its table may name, which
config fields a fine-tune must share with its base, which pipeline classes publish it, its tiny and real configs,
the keys and shapes its diffusers model has (from generated data, so a conversion need not import diffusers), and
its transformer's stages for port validate (a module loaded on demand).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Mapping

import tomllib

from porting.families.mapping import MappingTable, Naming, parse_table
from porting.families.ops import OpShapeError

from .meta import meta_state_shapes
from .shapes import ShapeTemplate, load_template
from .stages import TransformerStages

Shape = tuple[int, ...]


@dataclass(frozen=True)
class PipelineVariant:
    """What a published folder of one variant declares and needs."""

    pipeline: str
    text_encoder: str  # class the pipeline expects in text_encoder/
    guidance_embeds: bool
    out_layers: tuple[int, ...]  # the pipeline's default text_encoder_out_layers
    registers_is_distilled: bool  # whether the pipeline's config (model_index.json) records is_distilled
    title: str
    # further text encoders the pipeline takes, as (component folder, class): FLUX.1's T5 in text_encoder_2/
    more_text_encoders: tuple[tuple[str, str], ...] = ()
    default_steps: int = 50  # denoising steps when the user names none (a distilled base says 4 itself)
    # whether `latents=` passed to the pipeline is packed as tokens (batch, patches, in_channels), as FluxPipeline
    # takes it, rather than (batch, in_channels, H / 16, W / 16), as the FLUX.2 pipelines do
    packed_latents: bool = False

    @property
    def text_encoders(self) -> dict[str, str]:
        """Every text encoder component the pipeline takes and the class it expects there."""
        return {"text_encoder": self.text_encoder, **dict(self.more_text_encoders)}


class Family:
    """One model family. Subclasses set the class attributes and implement `derive_config`."""

    name: ClassVar[str]
    table_resource: ClassVar[str]  # file name in the `mappings` package
    shapes_resource: ClassVar[str | None] = None  # generated diffusers key/shape data in `mappings`
    title: ClassVar[str] = ""
    structural_fields: ClassVar[tuple[str, ...]] = ()
    pipelines: ClassVar[Mapping[str, PipelineVariant]] = {}
    tiny_config: ClassVar[Mapping[str, Any]] = {}
    real_configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    shape_terms: ClassVar[tuple[str, ...]] = ()  # sizes the generated shape data may be written in
    shape_probes: ClassVar[tuple[Mapping[str, Any], ...]] = ()  # configs the shape data is generated from
    # adapters: when an adapter's keys are modules of several families' tables in equal number, the family with the
    # highest priority reads it (one family's names may be a subset of another's)
    adapter_priority: ClassVar[int] = 0
    # compat: whether diffusers' from_single_file converter for this family strips a key prefix
    # (`model.diffusion_model.`) itself
    single_file_strips_prefix: ClassVar[bool] = True
    # the module whose STAGES runs the transformer stage by stage (`stages.TransformerStages`, for port validate);
    # it imports torch and diffusers, so it is named here and loaded only by `stages()`
    stages_module: ClassVar[str | None] = None
    # the module whose `export_spec(family, config, variant, variant_name)` declares what `port export` writes
    # (graph wrappers, example inputs; it imports torch, so it is named here and imported only by the export)
    export_module: ClassVar[str | None] = None

    def __init__(self, table: MappingTable | None = None, folder: Path | None = None) -> None:
        self._table = table
        self._folder = folder

    def resource_path(self, resource: str) -> Path:
        if self._folder is not None:
            return self._folder / resource
        return Path(str(resources.files("mappings").joinpath(resource)))

    def _read(self, resource: str) -> tuple[str, Path]:
        path = self.resource_path(resource)
        return path.read_text(), path

    @cached_property
    def table(self) -> MappingTable:
        if self._table is not None:
            return self._table
        text, path = self._read(self.table_resource)
        table = parse_table(tomllib.loads(text), path)
        if table.name != self.name:
            raise ValueError(f"{path}: table {table.name!r} registered as family {self.name!r}")
        return table

    @cached_property
    def shape_template(self) -> ShapeTemplate | None:
        if self.shapes_resource is None:
            return None
        text, path = self._read(self.shapes_resource)
        return load_template(text, path)

    @property
    def has_stages(self) -> bool:
        return self.stages_module is not None

    def stages(self) -> TransformerStages:
        """The family's stages and input builders (imports torch and diffusers)."""
        if self.stages_module is None:
            raise KeyError(f"{self.title or self.name} declares no transformer stages")
        return importlib.import_module(self.stages_module).STAGES

    @property
    def diffusers_class(self) -> str:
        return self.table.diffusers_class

    def derive_config(self, facts: Mapping[str, Any]) -> dict[str, Any]:
        """The diffusers config from the facts the table reads off shapes."""
        raise NotImplementedError

    def sizes(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Values the table's sizes and the shape data may name: the config plus derived widths."""
        return dict(config)

    def diffusers_shapes(self, config: Mapping[str, Any]) -> dict[str, Shape]:
        """Every tensor of the diffusers model for `config`: from the generated data when the family has it
        (no diffusers import), else from the model instantiated on the meta device."""
        template = self.shape_template
        if template is not None:
            return template.expand(self.sizes(config), self.table.blocks)
        return meta_state_shapes(self.diffusers_class, config)

    def expected_shapes(self, config: Mapping[str, Any], target: Naming) -> dict[str, Shape]:
        """Shapes the `target` naming must have for `config` (original shapes follow through the table)."""
        diffusers_shapes = self.diffusers_shapes(config)
        if target == "diffusers":
            return diffusers_shapes
        original: dict[str, Shape] = {}
        for step in self.table.expand(self.sizes(config), "diffusers"):
            if not all(s in diffusers_shapes for s in step.sources):
                continue
            try:
                shapes = step.op.shapes([diffusers_shapes[s] for s in step.sources])
            except OpShapeError:
                continue
            original.update(zip(step.targets, shapes))
        return original

    def config_mismatches(self, base: Mapping[str, Any], inferred: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """Structural fields on which a fine-tune's inferred config disagrees with its base."""
        return [(name, base[name], inferred[name]) for name in self.structural_fields
                if name in base and name in inferred and base[name] != inferred[name]]

    def default_variant(self, config: Mapping[str, Any]) -> str:
        """The publish variant for a transformer config when the base does not name its pipeline."""
        if not self.pipelines:
            raise KeyError(f"{self.title or self.name} has no pipeline flux-port publishes")
        return next(iter(self.pipelines))

    def variant_for(self, config: Mapping[str, Any], pipeline_class: str | None) -> str | None:
        """The publish variant of a folder: the one whose pipeline class model_index.json names, else the default
        for the transformer config; None for a family that publishes no pipeline."""
        if not self.pipelines:
            return None
        default = self.default_variant(config)
        named = [name for name, v in self.pipelines.items() if v.pipeline == pipeline_class]
        return default if default in named or not named else named[0]

    def export_spec(self, config: Mapping[str, Any], pipeline_class: str | None = None) -> Any:
        """What `port export` writes for a model of this family (a `porting.families.export_spec.ExportSpec`);
        KeyError when the family declares no export."""
        if self.export_module is None:
            raise KeyError(f"{self.title or self.name} declares no exportable components")
        name = self.variant_for(config, pipeline_class)
        variant = self.pipelines.get(name) if name is not None else None
        return importlib.import_module(self.export_module).export_spec(self, config, variant, name)

    def pipeline_fit(self, base: Path, config: Mapping[str, Any], variant: PipelineVariant) -> list[str]:
        """Problems that keep this transformer from working with the base's other components."""
        return []
