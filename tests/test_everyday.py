"""Issue 21: everyday use. Defaults that fit the machine, reports that never lock each other out, a CPU validation
that measures the CPU, hints that name a present device, an 80-column table, progress without a terminal."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from porting.pipeline.publish import publish

from .helpers import run_port

VALIDATE_FAST = ["--resolution", "32", "--text-len", "8", "--timesteps", "0.5"]
TQDM_BAR = re.compile(r"\d+%\|")  # what a tqdm bar prints: " 50%|█████     | 1/2 [..]"


@pytest.fixture(scope="module")
def published(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("everyday") / "published"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    return out


@pytest.fixture
def slow_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reading of the progress clock is 100 s after the last: each step looks slow, without sleeping."""
    from porting import progress

    now = [0.0]

    def clock() -> float:
        now[0] += 100.0
        return now[0]

    monkeypatch.setattr(progress, "clock", clock)


# --- 1. defaults that fit the device -------------------------------------------------------------------------------

def test_cpu_defaults_are_float32_and_a_small_size(published: Path, tmp_path: Path) -> None:
    from porting.pipeline.generate import CPU_DEFAULT_SIZE, default_size, generate
    from validation.image_compare import Side, _prepare

    assert default_size("cpu") == CPU_DEFAULT_SIZE == 256 and default_size("meta") == 1024
    assert default_size("cpu", published) == 64  # 16x16 latent patches of the demo's VAE (factor 2)
    result = generate(published, "a fox", steps=1, size=32, output=tmp_path / "a.png", progress=False)
    assert result.dtype == "fp32"
    assert _prepare(Side(published, None, "cpu"), "--dtype").dtype_name == "fp32"  # compare's default
    pipe_dtype = {p.dtype for p in __import__("porting.pipeline.pipeload", fromlist=["load"]).load(
        published, torch.device("cpu"), torch.float32).transformer.parameters()}
    assert pipe_dtype == {torch.float32}


def test_compare_on_cpu_defaults_to_a_few_prompts_at_a_small_size(published: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    run = run_port(capsys, "compare", published, published, "--steps", "1", "--out", tmp_path / "c")
    assert run.code == 0, run.err
    doc = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert len(doc["images"]) == 4 and (doc["settings"]["width"], doc["settings"]["height"]) == (64, 64)
    assert doc["reference"]["dtype"] == doc["candidate"]["dtype"] == "fp32"
    assert "on cpu: the first 4 of the 37 built-in prompts at 64 px by default" in run.msg


def test_help_says_the_cpu_defaults(capsys: pytest.CaptureFixture) -> None:
    for verb in ("generate", "compare", "bench"):
        text = " ".join(run_port(capsys, verb, "--help").out.split())
        assert "256" in text and "cpu" in text, verb


def test_estimate_printed_when_a_step_is_slow(published: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                              slow_clock: None) -> None:
    run = run_port(capsys, "generate", published, "--prompt", "a fox", "--size", "32", "--steps", "2",
                   "--output", tmp_path / "slow.png")
    assert run.code == 0, run.err
    assert "estimate: about 3 min 20 s for 2 step(s) (the first took 1 min 40 s)" in run.msg


def test_the_first_step_line_counts_the_first_steps_time(published: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Time passes only inside the denoising steps (50 s each, read by generate's step clock): the first line's
    elapsed time is the first step's, not the 0.0 s since the progress line was set up."""
    from porting import progress
    from porting.pipeline import generate as gen

    now = [0.0]

    def step_clock() -> float:
        now[0] += 50.0
        return now[0]

    monkeypatch.setattr(gen, "progress_clock", step_clock)
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    run = run_port(capsys, "generate", published, "--prompt", "a fox", "--size", "32", "--steps", "2",
                   "--output", tmp_path / "timed.png")
    assert run.code == 0, run.err
    first = next(line for line in run.err.splitlines() if line.startswith("denoising step 1/2"))
    assert first.startswith("denoising step 1/2 (50.00 s; 50 s elapsed, about 50 s left)"), first


def test_no_estimate_when_steps_are_fast(published: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = run_port(capsys, "generate", published, "--prompt", "a fox", "--size", "32", "--steps", "2",
                   "--output", tmp_path / "fast.png")
    assert run.code == 0 and "estimate:" not in run.err


# --- 2. reports/ is shared -----------------------------------------------------------------------------------------

def _verbs(root: Path) -> dict[str, list[str]]:
    transformer = root / "transformer"
    pub = root / "published"
    return {
        "validate": ["validate", transformer, *VALIDATE_FAST, "--quiet"],
        "compare": ["compare", pub, pub, "--candidate-transformer", transformer, "--prompt", "a fox", "--steps", "1",
                    "--size", "32", "--quiet"],
        "bench": ["bench", pub, "--transformer", transformer, "--offload", "none", "--task", "t2i", "--runs", "1",
                  "--warmup", "0", "--size", "32", "--steps", "1", "--quiet"],
    }


@pytest.fixture
def workspace(port: dict, tmp_path: Path) -> Path:
    """transformer/ and published/ side by side, as a recipe's workspace: every verb writes into one reports/."""
    import shutil

    shutil.copytree(port["transformer"], tmp_path / "transformer")
    publish(port["base"], port["transformer"], tmp_path / "published", report=port["pass"])
    return tmp_path


@pytest.mark.parametrize("order", [("validate", "compare", "bench", "validate"),
                                   pytest.param(("bench", "validate", "compare", "bench", "validate"),
                                                marks=pytest.mark.slow)])  # the second order: whole pipelines again
def test_any_order_of_verbs_reruns_cleanly(workspace: Path, capsys: pytest.CaptureFixture, order: tuple) -> None:
    from porting.ownership import foreign_entries

    verbs = _verbs(workspace)
    for verb in order:
        run = run_port(capsys, *verbs[verb])
        assert run.code == 0, f"{verb} after {order}: {run.err}"
    reports = workspace / "reports"
    assert sorted(p.name for p in reports.iterdir() if not p.name.startswith(".")) == sorted(set(order))
    for verb in set(order):
        assert len(list((reports / verb).glob("2*"))) == order.count(verb)  # one run folder per run
    assert foreign_entries(reports) == []  # all of it flux-port's
    # publish finds the newest validate run
    run = run_port(capsys, "publish", "--base", workspace / "published", "--transformer", workspace / "transformer",
                   "--out", workspace / "pub2")
    assert run.code == 0, run.err
    newest = sorted((reports / "validate").glob("2*"))[-1]
    assert f"using the validation report in {newest / 'report.json'}" in run.msg


def test_force_accepts_reports_written_inside_an_output(port: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    # a published folder whose transformer was validated in place: the default run folders land inside it
    # (as they do inside an ONNX export, DIR/reports/ next to DIR/transformer)
    pub = tmp_path / "pub"
    publish(port["base"], port["transformer"], pub, report=port["pass"])
    for _ in range(2):
        assert run_port(capsys, "validate", pub / "transformer", *VALIDATE_FAST, "--quiet").code == 0
    assert len(list((pub / "reports" / "validate").glob("*/report.json"))) == 2
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--out", pub, "--force", "--quiet")
    assert run.code == 0, run.err
    # a user's file inside that reports/ is still refused
    (pub / "reports").mkdir()
    (pub / "reports" / "notes.txt").write_text("mine")
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"], "--report",
                   port["pass"], "--out", pub, "--force", "--quiet")
    assert run.code == 2 and "notes.txt" in run.msg


# --- 3. a CPU validation measures the CPU --------------------------------------------------------------------------

def test_cpu_validation_defaults_to_emulated_intrinsic(port: dict, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    run = run_port(capsys, "validate", port["transformer"], *VALIDATE_FAST, "--out", tmp_path / "r")
    assert run.code == 0, run.err
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["intrinsic"] == "emulated" and doc["ratio_by_construction"] is False and doc["notices"] == []
    assert "by construction" not in run.msg
    assert doc["output"]["ratio"] != 1.0  # the CPU's bf16 kernels against the emulation: a measurement


def test_forced_native_intrinsic_on_the_cpu_says_ratio_1_by_construction(port: dict, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    run = run_port(capsys, "validate", port["transformer"], *VALIDATE_FAST, "--intrinsic", "native",
                   "--out", tmp_path / "r")
    assert run.code == 0, run.err
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["intrinsic"] == "native" and doc["ratio_by_construction"] is True
    assert doc["output"]["ratio"] == 1.0
    assert "ratio is 1 by construction and checks no device" in run.msg
    assert "1 by construction" in (tmp_path / "r" / "report.md").read_text()


# --- 4. hints fit the machine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("npu,cuda,want", [(True, False, "npu:0"), (False, True, "cuda"), (False, False, "cpu")])
def test_hints_name_a_present_device(port: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch, npu: bool, cuda: bool, want: str) -> None:
    from porting import devices

    monkeypatch.setattr(devices, "npu_importable", lambda: npu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert devices.validate_device() == want
    run = run_port(capsys, "convert", port["source"], "--out", tmp_path / "c")
    assert run.code == 0 and f"port validate {tmp_path / 'c'} --device {want}" in run.msg
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", tmp_path / "c", "--out",
                   tmp_path / "p")
    assert run.code == 1 and f"--device {want} " in run.msg
    assert (want == "npu:0") == ("npu:0" in run.msg)


# --- 5. 80 columns -------------------------------------------------------------------------------------------------

def test_block_table_fits_80_columns_with_short_names(port: dict, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    from validation.report import short_stage, terminal_table

    assert short_stage("transformer_blocks.3") == "double 3"
    assert short_stage("single_transformer_blocks.17") == "single 17"
    run = run_port(capsys, "validate", port["transformer"], *VALIDATE_FAST, "--out", tmp_path / "r", "--json")
    doc = json.loads(run.out)
    assert doc["blocks"][1]["stage"] == "transformer_blocks.0" and doc["blocks"][1]["original"] == "double_blocks.0"
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    table = terminal_table(doc)
    console.print(table)
    text = console.export_text()
    rows = [line for line in text.splitlines() if "│" in line]
    assert max(len(line) for line in rows) <= 80, text
    assert "double 0" in text and "single 1" in text and "transformer_blocks" not in text and "…" not in text
    assert all(column.header for column in table.columns)  # no empty column
    md = (tmp_path / "r" / "report.md").read_text()
    assert "transformer_blocks.0" in md and "double_blocks.0" in md


# --- 6. progress without a terminal --------------------------------------------------------------------------------

def test_generate_prints_a_line_per_step_and_no_library_bars(published: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLUX_PORT_DEBUG", raising=False)
    run = run_port(capsys, "generate", published, "--prompt", "a fox", "--size", "32", "--steps", "3",
                   "--output", tmp_path / "g.png")
    assert run.code == 0, run.err
    lines = [line for line in run.err.splitlines() if line.startswith("denoising step ")]
    assert [line.split(" (")[0] for line in lines] == [f"denoising step {i}/3" for i in (1, 2, 3)]
    assert not TQDM_BAR.search(run.err) and "Loading pipeline components" not in run.err


def test_compare_bench_validate_print_progress_lines(workspace: Path, capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLUX_PORT_DEBUG", raising=False)
    verbs = _verbs(workspace)
    runs = {verb: run_port(capsys, *[a for a in verbs[verb] if a != "--quiet"]) for verb in verbs}
    for verb, run in runs.items():
        assert run.code == 0, f"{verb}: {run.err}"
        assert not TQDM_BAR.search(run.err), f"{verb}: {run.err}"
    assert "rendered 1/2 (reference 1/1; " in runs["compare"].err
    assert "rendered 2/2 (candidate 1/1; " in runs["compare"].err
    assert "t2i/none run 1 done" in runs["bench"].err
    assert "validated stage 1/" in runs["validate"].err and "(embed; " in runs["validate"].err
    stages = [line for line in runs["validate"].err.splitlines() if line.startswith("validated stage ")]
    assert stages and all(" elapsed" in line for line in stages)  # one line per stage, with its time
    assert all(", about " in line and line.endswith(" left)") for line in stages[:-1])  # and what is left


def test_progress_lines_carry_the_elapsed_time_and_what_is_left(slow_clock: None, capsys) -> None:
    """Off a terminal, StepProgress prints one line per step with the time since the start and, until the last, the
    rest at the pace so far (each reading of the slow clock is 100 s after the last)."""
    from rich.console import Console

    from porting.progress import StepProgress

    console = Console(file=sys.stderr, force_terminal=False)
    with StepProgress(console, "validated stage", 3, unit="stage") as bar:
        for label in ("embed", "double 0", "final"):
            bar.advance(label)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["validated stage 1/3 (embed; 1 min 40 s elapsed, about 3 min 20 s left)",
                     "validated stage 2/3 (double 0; 3 min 20 s elapsed, about 1 min 40 s left)",
                     "validated stage 3/3 (final; 5 min 00 s elapsed)"]


def test_export_steps_are_timed_and_estimated_by_parameters(slow_clock: None, capsys) -> None:
    """TimedSteps (port export's progress): each step's line says when it starts; its end, how long it took; after a
    sized step (a component), the next says how long the rest should take at the same seconds per parameter."""
    from rich.console import Console

    from porting.progress import TimedSteps

    steps = TimedSteps(Console(file=sys.stderr, force_terminal=False))  # the clock reads 100
    steps("hashing the transformer weights")  # 200
    steps("exporting transformer", size=100, left=300)  # 300: hashing took 100 s
    steps("exporting text_encoder", size=300, left=0)  # 400: 100 s per 100 parameters, so about 300 s left
    steps.end()  # 500
    assert capsys.readouterr().err.splitlines() == [
        "hashing the transformer weights (at 1 min 40 s)",
        "  took 1 min 40 s (3 min 20 s in all)",
        "exporting transformer (at 3 min 20 s)",
        "  took 1 min 40 s (5 min 00 s in all)",
        "exporting text_encoder (at 5 min 00 s; about 5 min 00 s left)",
        "  took 1 min 40 s (6 min 40 s in all)"]
