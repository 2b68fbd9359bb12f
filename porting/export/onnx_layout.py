"""What `port export --format onnx` exports from a folder: its layout (pipeline or lone transformer), the components
asked for and their parameter counts, the weightless folders it carries, and the manifest it writes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from porting._files import read_config, read_json_object
from porting.errors import InputError, PortError, UsageError
from porting.families.export_spec import ExportSpec
from porting.paths import files_within, link_roots
from porting.resources import check_component_configs

MANIFEST = "flux-port-export.json"
DATA_SUFFIX = ".data"



@dataclass
class ComponentResult:
    name: str
    inputs: list[str]
    outputs: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    params: int
    onnx_bytes: int
    data_bytes: int
    export_s: float
    facts: dict[str, Any] = field(default_factory=dict)


def find_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    """The export manifest for an export folder or one of its component folders."""
    path = Path(path)
    for folder in (path, path.parent):
        if (folder / MANIFEST).is_file():
            manifest = read_json_object(folder / MANIFEST, "written by port export")
            for field, kind in (("source", dict), ("components", dict), ("dtype", str)):
                if not isinstance(manifest.get(field), kind):
                    raise InputError(f"{folder / MANIFEST}: {field!r} is {manifest.get(field)!r}; port export writes "
                                     f"{'an object' if kind is dict else 'a string'} there.",
                                     hint="The manifest is damaged or hand-edited; export again.")
            return folder, manifest
    raise InputError(f"{path}: no {MANIFEST} here or in the folder above; not written by port export.",
                     hint="Export first: port export FOLDER --format onnx --out DIR, then use DIR/transformer.")


@dataclass(frozen=True)
class Layout:
    """What is exported from a folder: its component source folders, pipeline or lone transformer, and what the
    model's family declares it exports."""

    sources: dict[str, Path]
    kind: str  # "pipeline" or "transformer"
    spec: ExportSpec
    family: str  # the family's registry name
    class_name: str  # the transformer's diffusers class


def model_spec(transformer_config: Path, pipeline_class: str | None = None) -> tuple[ExportSpec, str, str]:
    """The one seam between the export and the families: the family of a transformer config's `_class_name`, and the
    components it declares (for the pipeline class model_index.json names, when there is one)."""
    from porting.families import family_for_class

    cfg = read_config(transformer_config, "a transformer config")
    class_name = cfg.get("_class_name")
    try:
        family = family_for_class(str(class_name))
        spec = family.export_spec(cfg, pipeline_class)
    except KeyError as e:
        raise InputError(f"{transformer_config}: '_class_name' is {class_name!r}; port export knows no family "
                         f"that exports it ({e.args[0]}).",
                         hint="Point at a published folder (port publish --out) or a converted transformer "
                              "(port convert --out).") from None
    return spec, family.name, str(class_name)


def layout_of(folder: Path) -> Layout:
    """Component source folders of a pipeline folder, or of a lone transformer folder."""
    if (folder / "model_index.json").is_file():
        index = read_config(folder / "model_index.json", "a pipeline index")
        if not (folder / "transformer" / "config.json").is_file():
            raise InputError(f"{folder}: no transformer/config.json; port export reads the model's family there.")
        spec, family, class_name = model_spec(folder / "transformer" / "config.json", index.get("_class_name"))
        sources = {name: folder / c.source for name, c in spec.components.items() if (folder / c.source).is_dir()}
        return Layout(sources, "pipeline", spec, family, class_name)
    if (folder / "config.json").is_file():
        spec, family, class_name = model_spec(folder / "config.json")
        return Layout({"transformer": folder}, "transformer", spec, family, class_name)
    raise InputError(f"{folder}: neither a diffusers pipeline folder (model_index.json) nor a transformer "
                     "folder (config.json).", hint="Point at a published folder (port publish --out) or a "
                                                   "converted transformer (port convert --out).")


def files_to_copy(folder: Path, layout: Layout) -> dict[str, list[Path]]:
    """The files of the weightless folders (tokenizers, scheduler) an export carries, listed before any work; a link
    is followed only when it stays inside the source folder."""
    if layout.kind != "pipeline":
        return {}
    return {name: files_within(folder / name, link_roots(folder)) for name in layout.spec.copied
            if (folder / name).is_dir()}


def select(folder: Path, components: Sequence[str] | None) -> tuple[Layout, list[str], dict[str, int]]:
    """The layout of `folder`, the components asked for (all it has by default) and their parameter counts."""
    layout = layout_of(folder)
    spec, sources = layout.spec, layout.sources
    wanted = list(components) if components else list(sources)
    refused = [c for c in wanted if c in spec.refused]
    if refused:
        raise UsageError(f"--components {refused[0]}: {spec.title} does not export it: {spec.refused[refused[0]]}",
                         hint="Leave it out of --components.")
    unknown = [c for c in wanted if c not in spec.components]
    if unknown:
        raise PortError(f"--components {','.join(unknown)}: unknown for {spec.title}; choose from "
                        f"{', '.join(spec.components)}.")
    missing = [c for c in wanted if c not in sources]
    if missing:
        raise InputError(f"{folder}: no {', '.join(spec.components[c].source + '/' for c in missing)} folder to "
                         f"export {', '.join(missing)} from.")
    check_component_configs({c: sources[c] for c in wanted}, nbytes=0)  # hollow builds: the modules only
    params = {c: spec.components[c].count_params(sources[c]) for c in wanted}
    return layout, wanted, params


def step_sizes(wanted: Sequence[str], component: str, params: dict[str, int]) -> dict[str, int]:
    """`size` and `left` of a component's step: its parameters, and those of the components after it."""
    after = list(wanted)[list(wanted).index(component) + 1:]
    return {"size": params[component], "left": sum(params[c] for c in after)}



def copy_folders(folder: Path, staging: Path, copies: dict[str, list[Path]]) -> list[str]:
    copied = []
    for name, files in copies.items():
        (staging / name).mkdir()
        for f in files:
            dest = staging / name / f.relative_to(folder / name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        copied.append(name)
    return copied
