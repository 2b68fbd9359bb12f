"""port bench on CPU (rows, counters, honest offload rows) and publish carrying the measured tables into the card."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import write_report  # noqa: E402

from porting.pipeline.bench import Row, _relative, bench  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from tests.helpers import run_cli  # noqa: E402
from validation.image_compare import Side, compare  # noqa: E402


@pytest.fixture(scope="module")
def folder(port: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "klein"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    return out


def test_bench_rows_on_cpu(folder: Path, tmp_path: Path) -> None:
    result = bench(folder, modes=["none", "model", "group"], tasks=["t2i", "edit"], size=32, steps=2, runs=2,
                   warmup=0, out=tmp_path / "b")
    doc = result.doc
    assert json.loads((tmp_path / "b" / "bench.json").read_text()) == doc
    assert [(r["mode"], r["task"]) for r in doc["rows"]] == [(m, t) for m in ("none", "model", "group")
                                                              for t in ("t2i", "edit")]
    measured = [r for r in doc["rows"] if r["mode"] == "none"]
    for r in measured:
        assert r["status"] == "ok" and r["load_s"] > 0 and len(r["runs_s"]) == 2
        assert r["s_per_image"] == pytest.approx(statistics.median(r["runs_s"]), abs=1e-3)
        assert r["denoise_s"] < r["s_per_image"] and r["it_per_s"] == pytest.approx(2 / r["denoise_s"], rel=1e-2)
        assert r["memory"]["counter"].startswith("process peak RSS") and r["memory"]["peak_bytes"] > 10**7
        assert r["memory"]["reserved_bytes"] is None  # no allocator counters on CPU, and none invented
        assert r["vs_first"] == {"peak_memory": 0.0, "it_per_s": 0.0}
    for r in doc["rows"][2:]:  # offload needs an accelerator: reported, not measured
        assert r["status"] == "skipped" and "accelerator" in r["reason"] and r["it_per_s"] is None
    assert doc["baseline"] == {"t2i": "none", "edit": "none"} and doc["device"] == "cpu"
    assert doc["weights_sha256"] == json.loads((folder / "manifest.json").read_text())["weights_sha256"]
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "| t2i | none |" in md and "| edit | group | SKIPPED |" in md and "peak RSS" in md


def test_relative_change_against_the_first_measured_mode() -> None:
    def row(mode: str, status: str = "ok", peak: int = 0, its: float = 0.0) -> Row:
        return Row(mode, "edit", status, it_per_s=its or None, memory={"peak_bytes": peak} if peak else {})

    rows = [row("none", "oom"), row("model", peak=20 * 2**30, its=0.62), row("sequential", peak=5 * 2**30, its=0.31)]
    assert _relative(rows) == {"edit": "model"}  # the OOM row cannot be the baseline (the SVDQuant bf16 case)
    assert rows[0].vs_first == {} and rows[1].vs_first == {"peak_memory": 0.0, "it_per_s": 0.0}
    assert rows[2].vs_first["peak_memory"] == pytest.approx(-0.75) and rows[2].vs_first["it_per_s"] == \
        pytest.approx(-0.5)


def test_cli_bench_json_and_bad_mode(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["bench", str(folder), "--offload", "none,sequential", "--task", "t2i", "--size", "32",
                              "--steps", "1", "--runs", "1", "--warmup", "1", "--out", str(tmp_path / "b"), "--json"],
                             capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [r["status"] for r in doc["rows"]] == ["ok", "skipped"] and doc["out"] == str(tmp_path / "b")
    assert len(doc["rows"][0]["runs_s"]) == 1 and doc["settings"]["warmup"] == 1  # the warm-up call is not timed
    code, out, err = run_cli(["bench", str(folder), "--offload", "disk", "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "--offload 'disk'" in err and not (tmp_path / "c").exists()


def test_cli_bench_on_cpu_says_a_skip_once_counts_runs_and_its_card_table_fits_80_columns(
        folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped at 80 columns, every offload mode: the reason three modes are skipped is said once (it was said per
    row), each run says how many are done, the time so far and the time left; the model card's rows (long model
    names, four times the rows) stay a table at 80 columns, not a block of `key value` lines per row."""
    from rich.table import Table

    from porting.cli import _output
    from porting.cli.bench_cmd import bench_table
    from porting.pipeline.bench import CARD_ROWS

    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(["bench", str(folder), "--task", "t2i,edit", "--size", "32", "--steps", "1", "--runs",
                              "2", "--warmup", "0", "--out", str(tmp_path / "b")], capsys)
    assert code == 0, err
    reason = "offloading moves weights"
    assert sum(reason in line for line in err.splitlines()) == 1, err
    runs = [line.strip() for line in err.splitlines() if line.strip().startswith(("t2i/none run", "edit/none run"))]
    assert len(runs) == 4 and runs[0].startswith("t2i/none run 1 done (1/4 runs; ") and "left)" in runs[0], runs
    assert runs[-1].startswith("edit/none run 2 done (4/4 runs; ") and runs[-1].endswith("elapsed)"), runs
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    doc["rows"] = [{**row, "model": label} for label, _, _ in CARD_ROWS for row in doc["rows"]]
    table, _ = bench_table(doc)
    assert isinstance(table, Table)
    _output.Output().table(table)
    shown = capsys.readouterr().out
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    assert "┃ model" in shown and "│ 4-bit" in shown, shown  # a table, with its borders
    assert len(shown.splitlines()) < 4 * len(doc["rows"]), shown


def test_publish_puts_the_latest_tables_of_the_same_weights_in_the_card(port: dict, tmp_path: Path) -> None:
    work = tmp_path / "work"  # a folder of its own, so the shared tiny port's reports/ stay untouched
    shutil.copytree(port["transformer"], work / "transformer")
    report = write_report(work / "reports", port["weights"])
    cmp = compare(Side(port["base"]), Side(port["base"], work / "transformer"), prompts=["a red fox"], steps=1,
                  size=32)
    assert cmp.out.parent == (work / "reports" / "compare").resolve()  # the default place publish looks in
    b = bench(port["base"], transformer=work / "transformer", modes=["none"], tasks=["t2i"], size=32, steps=1,
              runs=1, warmup=0)
    assert b.out.parent == (work / "reports" / "bench").resolve()
    # an older comparison of the same weights and a newer one of other weights must both be passed over
    for name, created, weights in (("old", "2000-01-01T00:00:00Z", port["weights"]),
                                   ("other", "2999-01-01T00:00:00Z", "f" * 64)):
        doc = json.loads((cmp.out / "compare.json").read_text())
        doc["created"], doc["candidate"]["weights_sha256"] = created, weights
        doc["summary"]["psnr"]["mean"] = 1.2345
        (work / "reports" / "compare" / name).mkdir()
        (work / "reports" / "compare" / name / "compare.json").write_text(json.dumps(doc))

    publish(port["base"], work / "transformer", work / "published", report=report)
    card = (work / "published" / "README.md").read_text()
    psnr = cmp.doc["summary"]["psnr"]
    assert "## Image quality against the reference" in card and f"| {psnr['mean']:.2f} |" in card
    assert "1.23" not in card and "LPIPS was not measured" in card and "\n\n## Image quality" in card
    assert "## Speed and memory" in card and "| t2i | none |" in card and "peak RSS" in card

    # no measurements of these weights: the card has no such sections
    publish(port["base"], port["transformer"], tmp_path / "plain", report=port["pass"])
    assert "## Speed and memory" not in (tmp_path / "plain" / "README.md").read_text()


def test_offload_calls_fit_the_installed_diffusers(folder: Path) -> None:
    """bench refuses offload rows on CPU, but the calls behind them can still be checked here: offloading "to" the
    CPU must run and leave the image bit-identical. (sequential cannot: accelerate's CPU-to-CPU hooks fail inside
    accelerate; it is only exercised on an accelerator.)"""
    import numpy as np
    import torch

    from porting.pipeline import pipeload

    def image(offload: str) -> np.ndarray:
        pipe = pipeload.load(folder, torch.device("cpu"), torch.float32, offload=offload)
        return np.asarray(pipe(prompt="a fox", height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
                               generator=torch.Generator().manual_seed(0)).images[0])

    plain = image("none")
    for mode in ("model", "group"):
        assert np.array_equal(image(mode), plain), mode
