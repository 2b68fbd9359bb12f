"""Charts (issue 30, item 6): validate's per-block chart, referenced from report.md and shown in the published card;
bench's memory and s/image chart; and, without matplotlib (made unimportable in a subprocess), a text chart and a
line naming the `charts` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from porting.charts import BENCH_PNG, BLOCKS_PNG
from porting.pipeline.bench import bench
from porting.pipeline.publish import publish
from tests.helpers import run_port

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ("--resolution", "64", "--text-len", "32")


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def test_validate_draws_the_block_chart_and_publish_shows_it(port, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="the charts extra (in the test extra) draws the PNG")
    out = tmp_path / "v"
    run = run_port(capsys, "validate", port["transformer"], "--base", port["base"], *SMALL, "--out", out)
    assert run.code == 0, run.err
    assert _png(out / BLOCKS_PNG)
    md = (out / "report.md").read_text()
    assert "](blocks.png)" in md and "## Per-block error against the budget" in md
    assert "chart:" in run.err and BLOCKS_PNG in run.err
    published = tmp_path / "pub"
    publish(port["base"], port["transformer"], published, report=out)
    assert (published / BLOCKS_PNG).read_bytes() == (out / BLOCKS_PNG).read_bytes()
    card = (published / "README.md").read_text()
    validation = card[card.index("## Validation"):]
    assert f"]({BLOCKS_PNG})" in validation.split("\n## ", 1)[0]  # in the card's validation section
    assert BLOCKS_PNG in json.loads((published / "manifest.json").read_text())["files"]


def test_bench_draws_memory_and_time_per_offload_mode(port, tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the charts extra (in the test extra) draws the PNG")
    folder = tmp_path / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    result = bench(folder, modes=["none"], tasks=["t2i", "edit"], size=32, steps=1, runs=1, warmup=0,
                   out=tmp_path / "b")
    assert _png(result.out / BENCH_PNG)
    assert f"]({BENCH_PNG})" in (result.out / "bench.md").read_text()


SHIM = "import sys\nsys.modules['matplotlib'] = None  # import matplotlib now raises ImportError\n"


@pytest.mark.slow  # two interpreters with torch (validate, bench): ~15 s of CPU, minutes on a loaded machine
def test_without_matplotlib_the_reports_carry_a_text_chart_naming_the_extra(port, tmp_path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]), "COLUMNS": "80"}
    probe = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "import of matplotlib halted" in probe.stderr  # the shim works
    out = tmp_path / "v"
    run = subprocess.run([sys.executable, "-m", "porting", "validate", str(port["transformer"]), "--base",
                          str(port["base"]), *SMALL, "--out", str(out)], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert not (out / BLOCKS_PNG).exists()
    md = (out / "report.md").read_text()
    assert "matplotlib is not installed" in md and "flux-port[charts]" in md
    chart = md.split("## Per-block error against the budget", 1)[1].split("```")[1].strip().splitlines()
    assert len(chart) == len(json.loads((out / "report.json").read_text())["blocks"])
    assert all("of budget" in line and "#" in line for line in chart)
    assert "flux-port[charts]" in " ".join(run.stderr.split())  # said on the terminal too
    code = ("import sys; from porting.pipeline.bench import bench; "
            "bench(sys.argv[1], modes=['none'], tasks=['t2i'], size=32, steps=1, runs=1, warmup=0, out=sys.argv[2])")
    published = tmp_path / "klein"
    publish(port["base"], port["transformer"], published, report=port["pass"])
    run = subprocess.run([sys.executable, "-c", code, str(published), str(tmp_path / "b")], env=env,
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "b" / BENCH_PNG).exists()
    bench_md = (tmp_path / "b" / "bench.md").read_text()
    assert "flux-port[charts]" in bench_md and "seconds per image" in bench_md and "s/image" in bench_md
