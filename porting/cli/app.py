"""Composition root of the `port` command line."""

from __future__ import annotations

import difflib
import errno
import importlib
import os
import signal
import sys
from typing import Any, NamedTuple

import typer

from porting.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    DiskSpaceError,
    Interrupted,
    PlanError,
    PortError,
    Terminated,
    UsageError,
)

from . import _output
from ._lastresort import as_port_error


class Verb(NamedTuple):
    module: str  # porting.cli.<module>
    function: str  # the verb's function in it
    examples: str | None  # the name of its examples constant (the help's epilog), if any
    summary: str  # the first paragraph of the function's docstring: `port --help` lists it without the import


# The one place a verb is registered, in `port --help` order; a verb's module is imported only when it runs (or its
# help is asked for), so `port convert` loads nothing the other verbs need. tests/test_cli_startup.py keeps the
# summaries equal to the docstrings and every help text equal to the one an eager registration gives.
VERBS: dict[str, Verb] = {
    "fetch": Verb("fetch_cmd", "fetch", "FETCH_EXAMPLES", "Download a base model or fine-tune files into plain "
                  "folders, verified, resumable, with a manifest."),
    "recipes": Verb("fetch_cmd", "recipes", "RECIPES_EXAMPLES", "List the known ports: base repo, checkpoint to port, "
                    "variant and pipeline class."),
    "inspect": Verb("inspect_cmd", "inspect", "INSPECT_EXAMPLES", "Show naming, family, variant, dtypes, counts, the "
                    "inferred diffusers config and which runtimes load the file (reads headers only)."),
    "convert": Verb("convert_cmd", "convert", "CONVERT_EXAMPLES", "Convert FLUX.2 / FLUX.1 transformer weights (or a "
                    "LoRA / LyCORIS adapter) between original (BFL) and diffusers naming."),
    "merge": Verb("merge_cmd", "merge", "MERGE_EXAMPLES", "Add adapter deltas (W + strength * alpha / rank * B @ A; "
                  "LoKr, LoHa, diff) to a base, in its dtype."),
    "validate": Verb("validate_cmd", "validate", "VALIDATE_EXAMPLES", "Run the full transformer on the device against "
                     "a float32 golden and judge it against bf16's own error."),
    "demo": Verb("demo_cmd", "demo", None, "Port a tiny random fine-tune (FLUX.2 [klein] by default) end to end, "
                 "offline, and generate a PNG with it."),
    "publish": Verb("publish_cmd", "publish", "PUBLISH_EXAMPLES", "Assemble a diffusers pipeline folder from a base "
                    "repository and a converted, validated transformer."),
    "generate": Verb("generate_cmd", "generate", "GENERATE_EXAMPLES", "Generate an image from a published folder; "
                     "prints load time, denoising time, s/it and peak memory."),
    "compare": Verb("compare_cmd", "compare", "COMPARE_EXAMPLES", "Render the same prompts through two pipelines and "
                    "report PSNR / SSIM / LPIPS (mean, p50, p90), with a grid."),
    "bench": Verb("bench_cmd", "bench", "BENCH_EXAMPLES", "Measure a pipeline folder under each offload mode and task: "
                  "the speed/memory table of a model card."),
    "export": Verb("export_cmd", "export", "EXPORT_EXAMPLES", "Export a diffusers folder to ONNX (weights as external "
                   "data), ready for onnxruntime; or lint one (--check)."),
    "batch": Verb("batch_cmd", "batch", "BATCH_EXAMPLES", "Run fetch / convert / validate / publish / compare / export "
                  "for many models; a rerun redoes nothing finished."),
    "env": Verb("env_cmd", "env", "ENV_EXAMPLES", "Print flux-port's version, Python, torch and its builds, the "
                "libraries, the extras installed, the visible devices and the folders flux-port uses: what a bug "
                "report needs."),
}


def verb_command(name: str) -> typer.core.TyperCommand:
    """The click command of one verb, built as an eager registration builds it: options checked (`checked`, with
    the module's `preflight` where it has one: the refusals that need no model, before any is loaded), examples
    fitted to 80 columns (`_output.examples`)."""
    from ._options import checked

    verb = VERBS[name]
    module = importlib.import_module(f"porting.cli.{verb.module}")
    examples = getattr(module, verb.examples) if verb.examples else None
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    command = checked(getattr(module, verb.function), getattr(module, "preflight", None))
    one.command(epilog=_output.examples(examples) if examples else None)(command)
    command = typer.main.get_command(one)
    assert isinstance(command, typer.core.TyperCommand) and command.name == name, (name, command.name)
    return command


# typer vendors click; its exceptions are reached through a public subclass (typer.BadParameter)
ClickUsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class LazyVerbs(typer.core.TyperGroup):
    """The `port` group over `VERBS`: a verb's command is built when it is looked up, not before."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(VERBS)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> typer.core.TyperCommand | None:
        if cmd_name not in self.commands and cmd_name in VERBS:
            self.commands[cmd_name] = verb_command(cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: typer.Context, formatter: Any) -> None:
        listing = typer.core.TyperGroup(commands=[typer.core.TyperCommand(name, help=v.summary)
                                                  for name, v in VERBS.items()])
        listing.format_commands(ctx, formatter)

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> tuple[str | None, typer.core.TyperCommand | None,
                                                                            list[str]]:
        try:
            return self._click_resolve_command(ctx, args)
        except ClickUsageError as e:  # typer's "Did you mean", from the table instead of the loaded commands
            matches = difflib.get_close_matches(args[0], list(VERBS)) if args else []
            if matches:
                e.message = f"{e.message.rstrip('.')}. Did you mean {', '.join(repr(m) for m in matches)}?"
            raise


app = typer.Typer(
    name="port", cls=LazyVerbs, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None, help="Port FLUX.2 / FLUX.1 checkpoints to diffusers, with numerical proof.",
)


def _print_version(value: bool) -> None:
    if value:
        from porting import __version__

        print(f"flux-port {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print flux-port's version and exit (port env: the whole environment).")
          ) -> None:
    pass


# unknown option, bad value
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

INTERRUPTED = "the output being written was removed; nothing at the destination changed."
REPORT_INTERRUPTED = ("no report of this run was written (a run folder being written is removed, and so are the "
                      "reports/ folders this run made, when empty); earlier reports are unchanged.")
INTERRUPTED_BY_VERB = {  # what an interruption leaves, verb by verb (demo and fetch say it themselves)
    "validate": REPORT_INTERRUPTED, "compare": REPORT_INTERRUPTED, "bench": REPORT_INTERRUPTED,
    "inspect": "nothing was written.", "recipes": "nothing was written.",
    "fetch": "verified files and partial downloads are kept, to resume: run the same port fetch again.",
    "batch": "the steps that finished are recorded in the journal; the same port batch resumes after them.",
}


def verb_of(args: list[str]) -> str | None:
    """The verb of a command line (its first word that is not an option)."""
    return next((a for a in args if not a.startswith("-")), None)


def interrupted(verb: str | None, terminated: bool) -> Interrupted:
    """The interruption as one message: what stopped it (Ctrl-C or SIGTERM) and what the verb leaves."""
    return as_terminated(Interrupted(f"Interrupted (Ctrl-C): {INTERRUPTED_BY_VERB.get(verb or '', INTERRUPTED)}"),
                         terminated)


def as_terminated(err: PortError, terminated: bool) -> PortError:
    """An interruption that SIGTERM caused says so, with exit code 143 (128 + SIGTERM)."""
    if terminated and isinstance(err, Interrupted):
        text = err.message
        for head in ("Interrupted (Ctrl-C): ", "Interrupted (Ctrl-C). ", "Interrupted. ", "Interrupted: "):
            text = text.removeprefix(head)
        err.message = f"Terminated (SIGTERM): {text}"
        err.exit_code = EXIT_TERMINATED
    return err


_signals = {"terminated": False}


def _on_sigterm(signum, frame) -> None:
    """SIGTERM takes Ctrl-C's path (every staging folder is removed on the way out), once: a second SIGTERM during
    that cleanup is ignored so the cleanup finishes."""
    _signals["terminated"] = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def install_sigterm() -> object:
    """Install the SIGTERM handler; returns the one it replaced (main() puts it back), or None where none was."""
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (an embedding application): leave its handlers alone
        return None


def report_error(err: PortError) -> None:
    out = _output.current
    if out.json_mode and not out.documented:  # one JSON document on stdout, whatever happened
        doc = {"error": err.message, "hint": err.hint, "details": err.details, "exit_code": err.exit_code}
        if isinstance(err, PlanError) and err.report:
            doc["report"] = err.report
        out.document(doc)
    out.error(f"Error: {err.message}")
    if err.details:
        out.error(err.details, lines=True)
    if err.hint:
        out.error(f"Hint: {err.hint}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs a verb and turns every failure into one clear message and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    # errors raised before a verb parses its options (a bad value, an unknown option) still honour --json
    _output.current = _output.Output(json_mode="--json" in args)
    _signals["terminated"] = False
    previous = install_sigterm()
    try:
        _run(args)
    finally:
        if previous is not None:  # a caller in the same process (tests, an embedding tool) gets its handler back
            signal.signal(signal.SIGTERM, previous)


def _run(args: list[str]) -> None:
    resources = sys.modules.get("porting.resources")  # loaded by an earlier run in this process (tests, embedders):
    if resources is not None:  # its estimates are not this run's
        resources.ESTIMATES.clear()
    try:
        code = app(args=args, prog_name="port", standalone_mode=False)
    except PortError as err:
        report_error(as_terminated(err, _signals["terminated"]))
        if os.environ.get("FLUX_PORT_DEBUG"):
            raise
        sys.exit(err.exit_code)
    except ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # bare `port`: the help as text, not an escaped error line
            sys.stdout.write(err.format_message() + "\n")
            sys.exit(EXIT_USAGE)
        report_error(UsageError(err.format_message(), hint="See `port --help` or `port VERB --help`."))
        sys.exit(EXIT_USAGE)
    except (KeyboardInterrupt, typer.Abort):
        code = EXIT_INTERRUPTED
    except OSError as err:  # the disk or the OS said no where no verb expected it: still one clear message
        report_error(os_error(err))
        sys.exit(os_error(err).exit_code)
    except Exception as err:  # noqa: BLE001 - the last resort: one message and a documented code, no traceback
        mapped = as_port_error(err, args)
        report_error(mapped)
        if os.environ.get("FLUX_PORT_DEBUG"):
            raise
        sys.exit(mapped.exit_code)
    if code == EXIT_INTERRUPTED:  # typer turns Ctrl-C (and SIGTERM, which takes its path) into this exit code
        err = interrupted(verb_of(args), _signals["terminated"])
        report_error(err)
        sys.exit(err.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def os_error(err: OSError) -> PortError:
    where = f"{err.filename}: " if err.filename else ""
    if err.errno == errno.ENOMEM:  # the OS refused memory: the run does not fit, as an allocator's failure
        from porting.resources import out_of_memory

        return out_of_memory(err, str(err.filename or ""))
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(f"{where}the disk is full ({err.strerror}).", hint="Free some space and run it again.")
    return PortError(f"{where}{err.strerror or err}.", hint="Check the path and its permissions.")


if __name__ == "__main__":
    main()
