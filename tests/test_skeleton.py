"""Models built without memory (porting/skeleton.py) leave the tensors that imports make alone, and stay small.

`with torch.device("meta")` switched torch's default device: a module imported for the first time inside the block
made its module-level tensors on the meta device for the rest of the process (diffusers' BFL-scheme lookup table, so
every later nvfp4 dequantization failed). Each case runs in a fresh interpreter, since the bug depends on which import
comes first."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _child(case: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "tests.skeleton_child", case], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"{case}: the child failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [
    "count_meta",  # porting's path (the export's parameter counter), at klein-9B size
    pytest.param("svdq_fixture", marks=pytest.mark.slow),  # the fixture path that broke the oracle; a second ~10 s
])
def test_a_skeleton_built_first_leaves_the_bfl_lookup_table_on_the_cpu(case: str) -> None:
    out = _child(case)
    assert out["table_device"] == "cpu" and out["oracle_devices"] == ["cpu"], out
    # nvfp4 / fp8r of a Gaussian weight: about 10% / 3% relative error; a wrong table gives ~100%
    assert out["errors"]["single_blocks.0.linear1.weight"] < 0.2, out
    assert out["errors"]["double_blocks.0.img_attn.qkv.weight"] < 0.05, out
    if case == "count_meta":  # klein-9B (18 GB in bf16) and Qwen3-8B (16 GB): none of it allocated
        assert (out["params"], out["text_params"]) == (9_078_581_248, 8_190_735_360)
        # below the largest single parameter of either in float32 (klein-9B's linear1: 604 MB); with the imports the
        # build makes (about 150 MB), the weights 0
        assert out["peak_growth"] < 512 * 2**20 and out["text_peak_growth"] < 512 * 2**20, out


def _meta_device_blocks(tree: ast.AST) -> list[int]:
    """Lines of `with torch.device("meta")` and of direct calls to accelerate's init_empty_weights / init_on_device."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "device"
                        and any(isinstance(a, ast.Constant) and a.value == "meta" for a in call.args)):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "init_empty_weights", "init_on_device"):
            lines.append(node.lineno)
    return lines


def test_every_skeleton_is_built_by_porting_skeleton() -> None:
    """No `with torch.device("meta")` left, and accelerate's context called in one place (porting/skeleton.py)."""
    found = []
    for folder in ("porting", "validation", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "porting" / "skeleton.py":
                continue
            found += [f"{path.relative_to(ROOT)}:{n}" for n in _meta_device_blocks(ast.parse(path.read_text()))]
    assert not found, f"build these through porting.skeleton (empty_weights / diffusers_skeleton): {found}"
