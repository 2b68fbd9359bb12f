"""Issue 29, rule 3: a jobs file is checked whole before any step runs. Every option value goes through the checks
its verb's own command line applies (one test per option type: string, boolean, number, list), a false boolean for
a switch without a --no- form is refused, an over-long job name too, each with exit 2 naming the job, the step and
the option, and nothing created. A rerun trusts the journal only for outputs still as they were written; a damaged
journal is blamed as such; a Ray address with nothing there fails within --connect-timeout."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint
from porting.demo.tinypipe import build_demo_base

from .helpers import run_port


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch-checked")
    build_demo_base(root / "base")
    write_random_checkpoint(root / "a.safetensors", TINY_FLUX2, seed=5)
    return root


def _jobs(inputs: Path, tmp_path: Path, job: str, name: str = "a") -> Path:
    path = tmp_path / "jobs.toml"
    path.write_text(f'[defaults]\nbase = "{inputs / "base"}"\n\n[[job]]\nname = "{name}"\n'
                    f'source = "{inputs / "a.safetensors"}"\n{job}\n')
    return path


def _refused(capsys, inputs: Path, tmp_path: Path, job: str, *phrases: str) -> dict:
    out = tmp_path / "out"
    run = run_port(capsys, "batch", _jobs(inputs, tmp_path, job), "--out", out, "--json")
    assert run.code == 2, (run.code, run.out, run.err)
    error = json.loads(run.out)["error"]
    for phrase in ("[[job]] #1 (a)", *phrases):
        assert phrase in error, error
    assert not out.exists()  # nothing created, not even DIR
    return json.loads(run.out)


# --- one case per option type: string, boolean, number, list ---------------------------------------------------

CASES = {
    # a string: a choice, and text where a number goes
    "string-choice": ('steps = ["convert"]\nconvert = { dtype = "" }', 'convert.dtype = ""', "is not one of"),
    "string-for-int": ('steps = ["convert", "validate"]\nvalidate = { resolution = "big" }',
                       'validate.resolution = "big"', "is not a valid int"),
    # a boolean: only to a switch, and false only to a switch with a --no- form
    "bool-for-value": ('steps = ["convert", "validate"]\nvalidate = { resolution = false }',
                       "validate.resolution = false", "takes a value, not true or false"),
    "bool-false-no-form": ('steps = ["convert", "publish"]\npublish = { skip-validation = false }',
                           "publish.skip-validation = false", "no --no-skip-validation"),
    "number-for-switch": ('steps = ["convert"]\nconvert = { strict = 1 }', "convert.strict = 1", "is a switch"),
    # a number: the verb's type and range
    "number-float-for-int": ('steps = ["convert", "validate"]\nvalidate = { resolution = 64.5 }',
                             "validate.resolution = 64.5", "is not a valid int"),
    "number-below-range": ('steps = ["convert", "publish", "compare"]\ncompare = { steps = 0 }', "compare.steps = 0",
                           "needs at least 1"),
    "number-text": ('steps = ["convert", "publish", "export"]\nexport = { opset = "x" }', 'export.opset = "x"',
                    "is not a valid int"),
    # a list: only to an option that repeats, each item checked
    "list-for-single": ('steps = ["convert", "validate"]\nvalidate = { seeds = ["1", "2"] }',
                        'validate.seeds = ["1", "2"]', "takes one value, not a list"),
    "list-bad-item": ('steps = ["convert", "publish", "export"]\nexport = { target = "ryzenai", size = [64, "big"] }',
                      'export.size = [64, "big"]', "'big' is not a valid int"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_option_value_is_checked_as_its_verb_checks_it(capsys, inputs, tmp_path, case):
    job, shown, why = CASES[case]
    _refused(capsys, inputs, tmp_path, job, shown, why)


def test_a_false_switch_with_a_no_form_is_accepted_at_read_time(capsys, inputs, tmp_path):
    out = tmp_path / "out"
    run = run_port(capsys, "batch", _jobs(inputs, tmp_path, 'steps = ["convert"]\nconvert = { strict = false }'),
                   "--out", out, "--json")
    assert run.code == 0, run.out


@pytest.mark.parametrize("job, shown", [
    ('steps = ["convert", "validate"]\nvalidate = { resolution = 64.5 }', "validate.resolution = 64.5"),
    ('steps = ["convert", "publish", "compare"]\ncompare = { steps = 0 }', "compare.steps = 0"),
    ('steps = ["convert", "publish", "export"]\nexport = { opset = "x" }', 'export.opset = "x"'),
])
def test_a_number_is_checked_as_the_verb_checks_it(capsys, inputs, tmp_path, job, shown):
    _refused(capsys, inputs, tmp_path, job, shown)


@pytest.mark.parametrize("job, shown, why", [
    ('steps = ["convert", "validate"]\nvalidate = { seeds = ["1", "2"] }', 'validate.seeds = ["1", "2"]',
     "takes one value, not a list"),
    ('steps = ["convert", "publish", "export"]\nexport = { target = "ryzenai", size = [64, "big"] }',
     'export.size = [64, "big"]', "'big' is not a valid int"),
])
def test_a_list_goes_only_to_a_repeatable_option_and_each_item_is_checked(capsys, inputs, tmp_path, job, shown,
                                                                          why):
    _refused(capsys, inputs, tmp_path, job, shown, why)


def test_a_300_character_job_name_is_refused_before_anything_is_created(capsys, inputs, tmp_path):
    out = tmp_path / "out"
    run = run_port(capsys, "batch", _jobs(inputs, tmp_path, 'steps = ["convert"]', name="n" * 300), "--out", out,
                   "--json")
    assert run.code == 2 and "300 characters long; at most 200" in json.loads(run.out)["error"]
    assert not out.exists()


# --- the journal ------------------------------------------------------------------------------------------------------

def _steps_run(doc: dict) -> int:
    return doc["steps_run_now"]


def test_a_rerun_redoes_a_step_whose_output_changed(capsys, inputs, tmp_path):
    jobs, out = _jobs(inputs, tmp_path, 'steps = ["convert"]'), tmp_path / "out"
    first = run_port(capsys, "batch", jobs, "--out", out, "--json")
    assert first.code == 0 and _steps_run(json.loads(first.out)) == 1
    again = run_port(capsys, "batch", jobs, "--out", out, "--json")
    assert _steps_run(json.loads(again.out)) == 0  # unchanged: reused
    (out / "a" / "transformer" / "config.json").unlink()
    redo = run_port(capsys, "batch", jobs, "--out", out, "--json")
    assert redo.code == 0 and _steps_run(json.loads(redo.out)) == 1, redo.out
    assert (out / "a" / "transformer" / "config.json").is_file()


def test_an_over_deep_journal_is_blamed_not_the_jobs_file(capsys, inputs, tmp_path):
    jobs, out = _jobs(inputs, tmp_path, 'steps = ["convert"]'), tmp_path / "out"
    assert run_port(capsys, "batch", jobs, "--out", out, "--json").code == 0
    record = out / "a" / "journal" / "convert" / "step.json"
    record.write_text("[" * 10000 + "]" * 10000)
    run = run_port(capsys, "batch", jobs, "--out", out, "--json")
    doc = json.loads(run.out)
    assert run.code == 2 and str(record) in doc["error"] and "journal" in doc["error"]
    assert "jobs file is not at fault" in doc["error"] and str(record.parent) in doc["hint"]


# --- Ray --------------------------------------------------------------------------------------------------------------

def test_a_ray_address_with_nothing_there_fails_within_the_timeout(capsys, inputs, tmp_path):
    pytest.importorskip("ray", reason="the [ray] extra runs --executor ray")
    with socket.socket() as s:  # a port that was free a moment ago, with nothing listening now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    started = time.monotonic()
    run = run_port(capsys, "batch", _jobs(inputs, tmp_path, 'steps = ["convert"]'), "--out", out, "--executor",
                   "ray", "--address", f"127.0.0.1:{port}", "--connect-timeout", "1", "--json")
    assert time.monotonic() - started < 30
    assert run.code == 2 and f"--address 127.0.0.1:{port}" in json.loads(run.out)["error"]
    assert not out.exists()


def test_parallel_workers_that_do_not_fit_together_are_refused_before_anything(capsys, inputs, tmp_path):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[defaults]\nbase = "{inputs / "base"}"\nsteps = ["convert"]\n' + "".join(
        f'[[job]]\nname = "j{i}"\nsource = "{inputs / "a.safetensors"}"\n' for i in range(1000)))
    out = tmp_path / "out"
    run = run_port(capsys, "batch", jobs, "--out", out, "--parallel", "1000000000000", "--json")
    assert run.code == 2 and "--parallel: 1,000 processes on this host" in json.loads(run.out)["error"], run.out
    assert not out.exists()
