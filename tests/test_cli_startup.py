"""Verbs start light: `port` registers its verbs in one table (`porting.cli.app.VERBS`) and imports a verb's module
only when that verb runs. Every help text stays what an eager registration of the same functions prints, byte for
byte, and `port VERB --help` loads no other verb's module and no torch."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from porting.cli import _output
from porting.cli._options import checked
from porting.cli.app import VERBS, _root, app

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers")
# what `port --help` / `port VERB --help` may import of flux-port besides porting.cli's helpers and the verb's module
LIGHT = ("porting", "porting.cli", "porting.cli.app", "porting.errors", "porting.finite", "porting.text",
         "porting.pipeline", "porting.pipeline.variant_names")


def eager_app() -> typer.Typer:
    """The `port` app as it was built before the table: every verb module imported, every command registered."""
    eager = typer.Typer(name="port", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                        rich_markup_mode=None, help="Port FLUX.2 / FLUX.1 checkpoints to diffusers, with numerical "
                                                    "proof.")
    for verb in VERBS.values():
        module = importlib.import_module(f"porting.cli.{verb.module}")
        examples = getattr(module, verb.examples) if verb.examples else None
        eager.command(epilog=_output.examples(examples) if examples else None)(checked(getattr(module,
                                                                                             verb.function)))
    eager.callback()(_root)
    return eager


def printed(typer_app: typer.Typer, argv: list[str]) -> tuple[str, Any]:
    """(stdout, the exception or exit code) of `port ARGV` through `typer_app`, as `porting.cli.app._run` calls it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            result: Any = typer_app(args=argv, prog_name="port", standalone_mode=False)
        except SystemExit as e:
            result = e.code
        except Exception as e:  # noqa: BLE001 - a usage error: its message is compared
            result = (type(e).__name__, e.format_message() if hasattr(e, "format_message") else str(e))
    return out.getvalue(), result


@pytest.fixture(scope="module")
def eager() -> typer.Typer:
    return eager_app()


@pytest.mark.parametrize("columns", ["80", "200", "50"])
def test_every_help_text_is_the_eager_apps_byte_for_byte(eager: typer.Typer, monkeypatch, columns: str) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    for argv in [["--help"], []] + [[verb, "--help"] for verb in VERBS]:
        lazy_text, lazy_result = printed(app, argv)
        eager_text, eager_result = printed(eager, argv)
        assert lazy_text == eager_text, argv
        assert str(lazy_result) == str(eager_result), argv
        assert "Usage: port" in lazy_text + str(lazy_result), argv


@pytest.mark.parametrize("argv", [["convrt"], ["--bogus"], ["bogus"], ["convert", "--bogus"], ["merge"]])
def test_usage_errors_read_as_the_eager_apps(eager: typer.Typer, argv: list[str]) -> None:
    """An unknown verb keeps typer's suggestion ("Did you mean 'convert'?"), from the table."""
    assert printed(app, argv) == printed(eager, argv)
    if argv == ["convrt"]:
        assert "Did you mean 'convert'?" in str(printed(app, argv)[1])


def test_each_summary_is_the_first_paragraph_of_its_verbs_docstring() -> None:
    for name, verb in VERBS.items():
        function = getattr(importlib.import_module(f"porting.cli.{verb.module}"), verb.function)
        first = (inspect.getdoc(function) or "").split("\n\n")[0]
        assert verb.summary == " ".join(first.split()), name
        assert function.__name__ == name


def _loaded_after(argv: list[str]) -> dict[str, list[str]]:
    code = ("import json, sys\nfrom porting.cli.app import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(json.dumps({'verbs': sorted(m for m in sys.modules if m.startswith('porting.cli.') and "
            "m.endswith('_cmd')), 'heavy': sorted(m for m in %r if m in sys.modules), "
            "'rich': sorted(m for m in sys.modules if m.startswith('rich.')), "
            "'porting': sorted(m for m in sys.modules if m.split('.')[0] in ('porting', 'validation'))}))"
            % (argv, HEAVY))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[verb, "--help"] for verb in VERBS])
def test_a_verbs_help_imports_only_its_own_module_and_no_torch(argv: list[str]) -> None:
    loaded = _loaded_after(argv)
    own = [f"porting.cli.{VERBS[argv[0]].module}"] if argv[0] in VERBS else []
    assert {"verbs": loaded["verbs"], "heavy": loaded["heavy"]} == {"verbs": own, "heavy": []}
    assert loaded["rich"] == []  # help texts are click's plain text: rich is imported when a verb prints with it
    # beyond the verb's module, only the CLI's own helpers and the leaf modules of plain data: no family registry
    # (publish's --variant choices), no output/ownership machinery (demo's), nothing a run needs
    beyond = [m for m in loaded["porting"] if m not in own and not m.startswith("porting.cli._")]
    assert beyond == [m for m in beyond if m in LIGHT], sorted(set(beyond) - set(LIGHT))


def test_a_convert_run_imports_no_other_verbs_module(tmp_path: Path, tiny2_file: Path) -> None:
    loaded = _loaded_after(["convert", str(tiny2_file), "--out", str(tmp_path / "out"), "--json"])
    assert loaded["verbs"] == ["porting.cli.convert_cmd"]
    assert loaded["heavy"] == [] and loaded["rich"] == []  # a bf16 copy with --json prints no table
    assert (tmp_path / "out" / "flux-port.json").is_file()


def test_publishs_variant_choices_are_the_family_registrys() -> None:
    """`port publish --variant` lists names kept as data (its help imports no family): the same names, in the same
    order, as the registry's publishable variants."""
    from porting.cli.publish_cmd import VariantChoice
    from porting.families import pipeline_variants
    from porting.pipeline.variant_names import PIPELINE_VARIANTS

    assert PIPELINE_VARIANTS == tuple(pipeline_variants())
    assert [c.value for c in VariantChoice] == list(pipeline_variants())
