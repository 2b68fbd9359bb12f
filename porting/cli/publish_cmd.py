"""`port publish`: assemble the diffusers pipeline folder, gated on a passing validation report."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from porting.errors import InputError, PortError

from . import _output
from ._options import ForceOpt, JsonOpt, OptionalOutDirOpt, QuietOpt

if TYPE_CHECKING:
    from rich.table import Table

    from porting.pipeline.publish import PublishResult

PUBLISH_EXAMPLES = """\b
Examples:
  port publish --base ./FLUX.2-klein-4B --transformer ./transformer --report ./reports --out ./my-klein-ft
  port publish --base ./FLUX.2-klein-9B --transformer ./transformer --report ./reports/report.json \\
      --variant klein-kv --out ./my-klein-kv --link symlink
  port publish my-recipe
"""


class LinkChoice(str, Enum):
    hardlink = "hardlink"
    symlink = "symlink"
    copy = "copy"


def _variant_choices() -> type[Enum]:
    """The publish variants the family registry declares (torch-free: the registry is data)."""
    from porting.families import pipeline_variants

    return Enum("VariantChoice", {name: name for name in pipeline_variants()}, type=str)  # type: ignore[return-value]


VariantChoice = _variant_choices()


def summary_table(result: PublishResult) -> Table:
    from rich.table import Table

    d = result.to_dict()
    table = Table(title="published", show_header=False)
    table.add_row("folder", d["out"])
    table.add_row("pipeline", f"{d['pipeline']} (variant {d['variant']})")
    table.add_row("weights sha256", d["weights_sha256"])
    v = d["validation"]
    table.add_row("validation", v["message"] if v["status"] == "pass" else f"NOT VALIDATED: {v['message']}")
    table.add_row("files", f"{d['files']} ({', '.join(f'{n} {k}' for k, n in d['how'].items())}), "
                           f"{d['bytes'] / 1e9:.3f} GB")
    table.add_row("time", f"{d['seconds']:.1f} s")
    return table


def _recipe_paths(recipe: str, workspace: Path | None) -> Any:
    from porting.hub.workspace import recipe_paths

    return recipe_paths(recipe, workspace)


def _known_recipe(name: str) -> Any | None:
    """The shipped recipe of that name (its variant and base repo id), or None for a workspace-only recipe."""
    from porting.hub.recipes import get_recipe

    try:
        return get_recipe(name)
    except InputError:
        return None


def publish(
    recipe: Annotated[Optional[str], typer.Argument(help="Recipe whose workspace fetch/convert/validate filled "
                                                         "(instead of --base/--transformer).")] = None,
    base: Annotated[Optional[Path], typer.Option("--base", help="Diffusers-layout base repository folder.")] = None,
    transformer: Annotated[Optional[Path], typer.Option("--transformer", help="Folder port convert wrote.")] = None,
    out: OptionalOutDirOpt = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="report.json from port validate, or its "
                                                                    "folder.")] = None,
    link: Annotated[LinkChoice, typer.Option("--link", help="How base and transformer files enter the folder; "
                                             "hardlink falls back to copy across filesystems.")] = LinkChoice.hardlink,
    variant: Annotated[Optional[VariantChoice], typer.Option("--variant", help="Pipeline class; default: the "
                                                             "base's.")] = None,
    adapter: Annotated[Optional[list[Path]], typer.Option("--adapter", help="A folder port convert wrote for an "
                                                          "adapter; placed under adapters/NAME/ (repeatable).")] = None,
    base_model: Annotated[Optional[str], typer.Option("--base-model", help="Hub id of the base for the model card "
                                                      "(e.g. black-forest-labs/FLUX.2-klein-4B).")] = None,
    workspace: Annotated[Optional[Path], typer.Option("--workspace", help="Workspace root (FLUX_PORT_HOME, "
                                                      "./ports).")] = None,
    skip_validation: Annotated[bool, typer.Option("--skip-validation", rich_help_panel="Dangerous options",
                                                  help="Publish without a passing report; the model card says "
                                                       "so.")] = False,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Assemble a diffusers pipeline folder from a base repository and a converted, validated transformer."""
    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    if recipe is not None:
        if base is not None or transformer is not None:
            raise PortError("give either a RECIPE or --base/--transformer, not both.")
        paths = _recipe_paths(recipe, workspace)
        base, transformer = paths.base, paths.transformer
        out = out or paths.published
        report = report or paths.reports
        known = _known_recipe(recipe)
        if known is not None:
            variant = variant or VariantChoice(known.variant)
            base_model = base_model or known.base.repo
    missing = [flag for flag, value in (("--base", base), ("--transformer", transformer), ("--out", out))
               if value is None]
    if missing:
        raise PortError(f"port publish needs {', '.join(missing)} (or a RECIPE).",
                        hint="port publish --base BASE_DIR --transformer CONVERTED_DIR --report REPORT --out DIR")
    with output.bytes_progress("publishing") as (on_start, on_bytes):
        from porting.pipeline.publish import publish as run_publish

        result = run_publish(base, transformer, out, report=report, link=link.value, skip_validation=skip_validation,
                             variant=variant.value if variant else None, base_model=base_model, force=force,
                             adapters=adapter or (),
                             on_status=output.status, on_start=on_start, on_bytes=on_bytes)
    if recipe is not None:
        from porting.hub.workspace import record_step
        record_step(paths, "publish", result.to_dict())
    output.document(result.to_dict())
    output.table(summary_table(result))
    for notice in result.notices:
        output.warning(notice)
    output.hint(f'try it: port generate {result.out} --prompt "a red fox in the snow" --device cpu --size 256 '
                "--steps 4 --output fox.png")
