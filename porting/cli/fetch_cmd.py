"""`port fetch SOURCE|RECIPE` and `port recipes`: bases and checkpoints from the Hub, a mirror or ModelScope."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from porting.errors import InputError

from . import _output
from ._options import JsonOpt, QuietOpt, WorkspaceOpt, out_option

if TYPE_CHECKING:
    from rich.table import Table

    from porting.hub.fetch.engine import FetchOptions, FetchResult, Reporter
    from porting.hub.fetch.sources import Source

FETCH_EXAMPLES = """\b
Examples:
  port fetch flux2-klein-9b-true-v1 --from modelscope
  port fetch flux2-klein-9b-true-v1 --from mirror --dry-run
  port fetch hf:black-forest-labs/FLUX.2-klein-4B --include "*.json" --include "tokenizer/" --out ./klein-4b
  port fetch hf:wikeeyang/Flux2-Klein-9B-True-V1 --file Flux2-Klein-9B-True-bf16.safetensors --from mirror
  port fetch modelscope:black-forest-labs/FLUX.2-klein-9B --revision master --json
  port fetch hf:ORG/NAME --endpoint https://my-mirror.example --send-token
"""

RECIPES_EXAMPLES = """\b
Examples:
  port recipes
  port recipes --json
"""


class FromChoice(str, Enum):
    hf = "hf"
    mirror = "mirror"
    modelscope = "modelscope"


def _summary(result: FetchResult) -> Table:
    from rich.table import Table

    from porting.hub.fetch.plan import human

    title = f"recipe {result.recipe.name} ({result.recipe.pipeline})" if result.recipe else "fetch"
    table = Table(title=title + (" - dry run" if result.dry_run else ""))
    for col in ("part", "source", "revision", "folder", "files", "size",
                "to download" if result.dry_run else "this run"):
        table.add_column(col)
    for run in result.parts:
        p = run.plan
        rev = p.listing.revision + (f" -> {p.listing.commit[:12]}" if p.listing.commit else "")
        table.add_row(p.part, _output.cell(p.source.label, p.source.endpoint), rev, str(p.out),
                      str(len(p.files)),
                      human(p.total_bytes), human(p.missing_bytes) if result.dry_run else
                      f"{len(run.fetched)} downloaded, {len(p.files) - len(run.fetched)} already there")
    return table


def _file_table(result: FetchResult) -> Table:
    from rich.table import Table

    from porting.hub.fetch.plan import human

    table = Table(title="files")
    for col in ("part", "path", "size", "state", "check"):
        table.add_column(col)
    for run in result.parts:
        for f in run.plan.files:
            state = f.state + (f" ({human(f.have)} on disk)" if f.state == "partial" else "")
            table.add_row(run.plan.part, f.remote.path, human(f.remote.size), state, f.remote.check)
    return table


def _run(src: Source | None, source: str, via: str | None, endpoint: str | None,
         finetune_from: FromChoice | None, workspace: Path | None, out: Path | None, opts: FetchOptions,
         ui: Reporter) -> FetchResult:
    from porting.hub.fetch.engine import fetch_recipe, fetch_source
    from porting.hub.recipes import get_recipe

    if src is None:
        recipe = get_recipe(source)
        given = [flag for flag, value in (("--revision", opts.revision), ("--include", opts.include),
                                          ("--exclude", opts.exclude), ("--file", opts.files), ("--out", out))
                 if value]
        if given:
            raise InputError(f"{', '.join(given)} cannot be used with a recipe; the recipe fixes its files and "
                             f"folders.", hint=f"Use --workspace DIR to place {recipe.name}/ elsewhere, or fetch a "
                                               f"repository directly: port fetch hf:{recipe.base.repo} ...")
        return fetch_recipe(recipe, via, endpoint, finetune_from.value if finetune_from else None, workspace,
                            opts, ui)
    if workspace is not None or finetune_from is not None:
        raise InputError("--workspace and --finetune-from apply to recipes only.",
                         hint="Use --out DIR for a repository's files.")
    if opts.files and (opts.include or opts.exclude):
        raise InputError("Give either --file or --include / --exclude, not both.")
    return fetch_source(src, out or Path(src.repo.split("/")[1]), opts, ui)


def fetch(
    source: Annotated[str, typer.Argument(metavar="SOURCE_OR_RECIPE", help="hf:ORG/NAME, modelscope:ORG/NAME, "
                                          "ORG/NAME (hub from --from) or a recipe name (see `port recipes`).")],
    from_: Annotated[Optional[FromChoice], typer.Option("--from", help="Hub to use: hf (huggingface.co), mirror "
                                                        "(hf-mirror.com) or modelscope. Recipes: default is the "
                                                        "recipe's first hub.")] = None,
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="Another endpoint URL for that hub, or an "
                                                    "alias: hf-mirror. Default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, "
                                                    "else the hub.")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch, tag or commit (default main on "
                                                    "the Hub, master on ModelScope).")] = None,
    include: Annotated[Optional[list[str]], typer.Option("--include", help="Only files matching this glob "
                                                         "(repeatable; '*' stops at '/', '**' crosses folders, "
                                                         "'dir/' is a folder).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="Skip files matching this glob "
                                                         "(repeatable).")] = None,
    file: Annotated[Optional[list[str]], typer.Option("--file", help="Exactly this file path of the repo "
                                                      "(repeatable).")] = None,
    out: Annotated[Optional[Path], out_option("--out", "-o", help="Folder for a repository's files "
                                                "(default ./NAME). Recipes use the workspace.")] = None,
    workspace: WorkspaceOpt = None,
    finetune_from: Annotated[Optional[FromChoice], typer.Option("--finetune-from", help="Recipes: hub for the "
                                                                "fine-tune part when it differs from --from.")] = None,
    send_token: Annotated[bool, typer.Option("--send-token", help="Also send your token to an endpoint that is not "
                                             "the hub's own host (a mirror). Off by default.",
                                             rich_help_panel="Security")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds to wait for a server before "
                                           "counting the attempt as failed.")] = 60.0,
    retries: Annotated[int, typer.Option("--retries", min=0, max=20, help="Attempts per file after a network "
                                         "error (each resumes).")] = 3,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List, plan and check disk space needs; download "
                                          "nothing.")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Download a base model or fine-tune files into plain folders, verified, resumable, with a manifest."""
    from porting.hub.fetch.engine import FetchOptions, Interrupted, Reporter
    from porting.hub.fetch.sources import parse_source

    output = _output.use(json_mode=json_, quiet=quiet)
    opts = FetchOptions(revision=revision, include=include or [], exclude=exclude or [], files=file or [],
                        dry_run=dry_run, send_token=send_token, timeout=timeout, retries=retries)
    ui = Reporter(status=output.status, warning=output.warning, console=None if output.quiet else output.err)
    via = from_.value if from_ else None
    src = parse_source(source, via=via, endpoint=endpoint)
    try:
        result = _run(src, source, via, endpoint, finetune_from, workspace, out, opts, ui)
    except KeyboardInterrupt:
        raise Interrupted("Interrupted. Verified files and partial downloads are kept.",
                          hint="Run the same command again to continue where it stopped.") from None

    output.document(result.to_dict())
    output.table(_summary(result))
    if result.dry_run:
        output.table(_file_table(result))
        output.hint("nothing was downloaded (--dry-run); run the same command without it to fetch.")
        return
    for run in result.parts:
        output.result(f"{run.plan.part}: {len(run.plan.files)} file(s) verified in {run.plan.out} "
                      f"(manifest {run.manifest_path})")
    if result.recipe:
        output.hint(f"convert it next: port convert {result.recipe.name}")


def recipes(json_: JsonOpt = False) -> None:
    """List the known ports: base repo, checkpoint to port, variant and pipeline class."""
    from rich.table import Table

    from porting.hub.recipes import load_recipes

    output = _output.use(json_mode=json_)
    known = load_recipes()
    output.document({"recipes": [r.to_dict() for r in known.values()]})
    table = Table(title="recipes (port fetch NAME --from hf|mirror|modelscope)")
    for col in ("name", "variant / pipeline", "base", "checkpoint to port", "description"):
        table.add_column(col)
    for r in known.values():
        ft = r.finetune
        table.add_row(r.name, _output.cell(r.variant, r.pipeline),
                      _output.cell(r.base.repo, f"({', '.join(r.base.hubs)})"),
                      _output.cell(f"{ft.repo}: {', '.join(ft.files) or 'selected files'}", f"({', '.join(ft.hubs)})")
                      if ft else "-", r.description)
    output.table(table)
