"""Composition root of the `port` command line."""

from __future__ import annotations

import os
import sys

import typer

from porting.errors import PlanError, PortError

from . import _output
from .convert_cmd import CONVERT_EXAMPLES, convert
from .demo_cmd import demo
from .fetch_cmd import FETCH_EXAMPLES, RECIPES_EXAMPLES, fetch, recipes
from .generate_cmd import GENERATE_EXAMPLES, generate
from .inspect_cmd import INSPECT_EXAMPLES, inspect
from .merge_cmd import MERGE_EXAMPLES, merge
from .publish_cmd import PUBLISH_EXAMPLES, publish
from .validate_cmd import VALIDATE_EXAMPLES, validate

app = typer.Typer(
    name="port", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None, help="Port FLUX.2 / FLUX.1 checkpoints to diffusers, with numerical proof.",
)
app.command(epilog=FETCH_EXAMPLES)(fetch)
app.command(epilog=RECIPES_EXAMPLES)(recipes)
app.command(epilog=INSPECT_EXAMPLES)(inspect)
app.command(epilog=CONVERT_EXAMPLES)(convert)
app.command(epilog=MERGE_EXAMPLES)(merge)
app.command(epilog=VALIDATE_EXAMPLES)(validate)
app.command()(demo)
app.command(epilog=PUBLISH_EXAMPLES)(publish)
app.command(epilog=GENERATE_EXAMPLES)(generate)


def report_error(err: PortError) -> None:
    out = _output.current
    if out.json_mode:
        doc = {"error": err.message, "hint": err.hint, "details": err.details, "exit_code": err.exit_code}
        if isinstance(err, PlanError) and err.report:
            doc["report"] = err.report
        out.document(doc)
    out.err.print(f"Error: {err.message}", markup=False, soft_wrap=True)
    if err.details:
        out.err.print(err.details, markup=False, soft_wrap=True)
    if err.hint:
        out.err.print(f"Hint: {err.hint}", markup=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs a verb and turns flux-port errors into one clear message and an exit code."""
    try:
        app(args=argv, prog_name="port", standalone_mode=True)
    except PortError as err:
        report_error(err)
        if os.environ.get("FLUX_PORT_DEBUG"):
            raise
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        _output.current.err.print("Interrupted; no partial output was left behind.")
        sys.exit(130)


if __name__ == "__main__":
    main()
