"""`port publish`: assemble the diffusers pipeline folder, gated on a passing validation report."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from porting.errors import InputError, PortError
from porting.pipeline.variant_names import PIPELINE_VARIANTS

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
  port publish my-recipe --push my-org/my-klein-ft                    (private; HF_TOKEN or `hf auth login`)
  port publish my-recipe --push my-org/my-klein-ft --push-to modelscope --public
"""


class PushHub(str, Enum):
    hf = "hf"
    modelscope = "modelscope"


class LinkChoice(str, Enum):
    hardlink = "hardlink"
    symlink = "symlink"
    copy = "copy"


def _variant_choices() -> type[Enum]:
    """The publish variants the family registry declares, from their names kept as data (the registry itself is
    imported when a publish runs, not for its help)."""
    return Enum("VariantChoice", {name: name for name in PIPELINE_VARIANTS}, type=str)  # type: ignore[return-value]


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


def push_rows(table: Table, push: dict[str, Any]) -> None:
    table.add_row("pushed to", f"{push['hub']}:{push['repo']} ({'private' if push['private'] else 'public'}"
                               f"{', created' if push['created'] else ''}) {push['url']}")
    sent = ("nothing uploaded: the hub already holds these files" if push["nothing_uploaded"] else
            f"{len(push['uploaded_files'])} file(s) uploaded ({push['uploaded_bytes'] / 1e6:,.1f} MB), "
            f"{push['unchanged_files']} unchanged" + (f", {len(push['deleted_files'])} deleted"
                                                       if push["deleted_files"] else ""))
    table.add_row("upload", sent)
    table.add_row("revision", f"{push['revision']} (checked: {push['checked_files']} files match manifest.json)"
                  + (f"; model card stamped in {push['card_revision']}" if push["card_revision"] else ""))


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
    push: Annotated[Optional[str], typer.Option("--push", rich_help_panel="Upload", metavar="ORG/NAME",
                                                help="After publishing, upload the folder to this repository "
                                                     "(created private unless --public); check what landed.")] = None,
    push_to: Annotated[PushHub, typer.Option("--push-to", rich_help_panel="Upload",
                                             help="Hub for --push.")] = PushHub.hf,
    public: Annotated[bool, typer.Option("--public", rich_help_panel="Upload",
                                         help="Create the --push repository public (default: private).")] = False,
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", rich_help_panel="Upload",
                                                    help="Endpoint for --push: a URL or alias; default HF_ENDPOINT / "
                                                         "MODELSCOPE_ENDPOINT, else the hub.")] = None,
    send_token: Annotated[bool, typer.Option("--send-token", rich_help_panel="Upload",
                                             help="Send the token to an --endpoint that is not the hub's own "
                                                  "host.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1, max=86400, rich_help_panel="Upload",
                                           help="Seconds --push waits for an answer before giving up (exit 4; at most "
                                                "a day, 86400).")
                       ] = 120.0,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Assemble a diffusers pipeline folder from a base repository and a converted, validated transformer."""
    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    paths = None
    if recipe is not None:
        _one_source(recipe, base, transformer)
        paths = _recipe_paths(recipe, workspace)
        base, transformer, out, report = paths.base, paths.transformer, out or paths.published, report or paths.reports
        variant, base_model = _recipe_defaults(recipe, variant, base_model)
    _missing(base, transformer, out)
    pusher = _push_preflight(push, push_to, public, endpoint, send_token, timeout, skip_validation, output)
    with output.bytes_progress("publishing") as (on_start, on_bytes):
        from porting.pipeline.publish import publish as run_publish

        result = run_publish(base, transformer, out, report=report, link=link.value, skip_validation=skip_validation,
                             variant=variant.value if variant else None, base_model=base_model, force=force,
                             adapters=adapter or (),
                             on_status=output.status, on_start=on_start, on_bytes=on_bytes)
    doc = result.to_dict()
    if pusher is not None:
        doc["push"] = _push(pusher, result.out, output)
    if paths is not None:
        from porting.hub.workspace import record_step
        record_step(paths, "publish", doc)
    output.document(doc)
    table = summary_table(result)
    if pusher is not None:
        push_rows(table, doc["push"])
    output.table(table)
    for notice in result.notices:
        output.warning(notice)
    output.hint(f'try it: port generate {result.out} --prompt "a red fox in the snow" --device cpu --size 256 '
                "--steps 4 --output fox.png")


def preflight(*, recipe: Optional[str], base: Optional[Path], transformer: Optional[Path], out: Optional[Path],
              push: Optional[str], push_to: PushHub, public: bool, endpoint: Optional[str], send_token: bool,
              timeout: float, skip_validation: bool, **_: Any) -> None:
    """publish's refusals that need no folder (the inputs given, the --push options and the repository id's form),
    before any model library is imported (`_options.checked` runs it)."""
    _one_source(recipe, base, transformer)
    if recipe is None:
        _missing(base, transformer, out)
    _push_target(push, push_to, public, endpoint, send_token, timeout, skip_validation)


def _one_source(recipe: Optional[str], base: Optional[Path], transformer: Optional[Path]) -> None:
    if recipe is not None and (base is not None or transformer is not None):
        raise PortError("give either a RECIPE or --base/--transformer, not both.")


def _missing(base: Optional[Path], transformer: Optional[Path], out: Optional[Path]) -> None:
    missing = [flag for flag, value in (("--base", base), ("--transformer", transformer), ("--out", out))
               if value is None]
    if missing:
        raise PortError(f"port publish needs {', '.join(missing)} (or a RECIPE).",
                        hint="port publish --base BASE_DIR --transformer CONVERTED_DIR --report REPORT --out DIR")


def _recipe_defaults(recipe: str, variant: Optional[VariantChoice],
                     base_model: Optional[str]) -> tuple[Optional[VariantChoice], Optional[str]]:
    """--variant and --base-model as given, else a known recipe's."""
    known = _known_recipe(recipe)
    if known is None:
        return variant, base_model
    return variant or VariantChoice(known.variant), base_model or known.base.repo


def _push(pusher: Any, out: Path, output: _output.Output) -> dict[str, Any]:
    """Upload the published folder; a failure or an interrupt says how to resume."""
    from porting.hub.push import push_folder

    try:
        return push_folder(pusher, out, say=output.status).to_dict()
    except PortError as err:
        if getattr(err, "resumable", True):  # a file changed since validation: no rerun uploads it
            err.hint = f"{err.hint + ' ' if err.hint else ''}{_resume_hint(out)}"
        raise
    except KeyboardInterrupt:
        from porting.errors import Interrupted

        raise Interrupted(f"Interrupted during the upload to {pusher.target.source.label}: the folder "
                          f"{out} is published, the upload is incomplete.", hint=_resume_hint(out)) from None


def _resume_hint(out: Path) -> str:
    return (f"The folder {out} is published; the same command with --force publishes it again identically and "
            "resumes the upload (what the hub already stores is not sent again).")


def _push_preflight(push: str | None, push_to: PushHub, public: bool, endpoint: str | None, send_token: bool,
                    timeout: float, skip_validation: bool, output: Any) -> Any:
    """Every refusal of --push that needs no folder (name, token, owner), before publish does any work."""
    target = _push_target(push, push_to, public, endpoint, send_token, timeout, skip_validation)
    if target is None:
        return None
    from porting.hub.push import preflight

    output.status(f"checking the token and {target.source.label} on {target.source.host} before publishing")
    return preflight(target)


def _push_target(push: str | None, push_to: PushHub, public: bool, endpoint: str | None, send_token: bool,
                 timeout: float, skip_validation: bool) -> Any:
    """The --push options checked without the network (what applies, the repository id's form, whether a token may
    go to the endpoint): the target, or None without --push."""
    if push is None:
        given = [flag for flag, on in (("--push-to", push_to != PushHub.hf), ("--public", public),
                                       ("--endpoint", endpoint is not None), ("--send-token", send_token),
                                       ("--timeout", timeout != 120.0)) if on]
        if given:
            raise PortError(f"{', '.join(given)} only apply with --push ORG/NAME.")
        return None
    if skip_validation:
        raise PortError("--push with --skip-validation: flux-port uploads only folders that passed the validation "
                        "gate.", hint="Validate the transformer (port validate), then publish with --push; or publish "
                                      "with --skip-validation and upload that folder yourself.")
    from porting.hub.push.target import push_target

    return push_target(push, push_to.value, endpoint=endpoint, public=public, send_token=send_token, timeout=timeout)
