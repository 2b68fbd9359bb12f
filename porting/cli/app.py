"""Composition root of the `port` command line."""

from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Any, Callable

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
from ._options import checked
from .batch_cmd import BATCH_EXAMPLES, batch
from .bench_cmd import BENCH_EXAMPLES, bench
from .compare_cmd import COMPARE_EXAMPLES, compare
from .convert_cmd import CONVERT_EXAMPLES, convert
from .demo_cmd import demo
from .env_cmd import ENV_EXAMPLES, env
from .export_cmd import EXPORT_EXAMPLES, export
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


def verb(command: Callable[..., Any], examples: str | None = None) -> None:
    """Register a verb: its options checked (`checked`), its examples fitted to 80 columns (`_output.examples`)."""
    app.command(epilog=_output.examples(examples) if examples else None)(checked(command))


verb(fetch, FETCH_EXAMPLES)
verb(recipes, RECIPES_EXAMPLES)
verb(inspect, INSPECT_EXAMPLES)
verb(convert, CONVERT_EXAMPLES)
verb(merge, MERGE_EXAMPLES)
verb(validate, VALIDATE_EXAMPLES)
verb(demo)
verb(publish, PUBLISH_EXAMPLES)
verb(generate, GENERATE_EXAMPLES)
verb(compare, COMPARE_EXAMPLES)
verb(bench, BENCH_EXAMPLES)
verb(export, EXPORT_EXAMPLES)
verb(batch, BATCH_EXAMPLES)
verb(env, ENV_EXAMPLES)


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


# typer vendors click; its ClickException (unknown option, bad value) is reached through a public subclass
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
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(f"{where}the disk is full ({err.strerror}).", hint="Free some space and run it again.")
    return PortError(f"{where}{err.strerror or err}.", hint="Check the path and its permissions.")


if __name__ == "__main__":
    main()
