"""The transcripts in README.md and docs/ are what the commands print (issue 30, item 8): docs/transcripts.py reruns
them; the README once showed a 0.80x ratio the demo never printed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("transcripts", ROOT / "docs" / "transcripts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RATIO = re.compile(r"output error ([\d.]+) %.*?bf16 itself costs ([\d.]+) %.*?the port's error is ([\d.]+)x", re.S)


def test_every_transcript_block_names_a_command_and_its_ratios_add_up() -> None:
    t = _module()
    found = {name: body for doc in t.documents() for name, body in t.blocks(doc.read_text(encoding="utf-8"))}
    assert set(found) == set(t.TRANSCRIPTS) and all(found.values())  # each refreshed, none left empty
    for name, body in found.items():
        checked = 0
        for device, own, ratio in RATIO.findall(body):
            # the printed errors have 3 significant digits: the ratio they give is within their rounding
            assert float(ratio) == pytest.approx(float(device) / float(own), rel=0.02), (name, device, own, ratio)
            checked += 1
        assert checked >= 1, name
        assert all(len(line) <= 80 for line in body.splitlines()), name  # piped at 80 columns


@pytest.mark.slow  # reruns `port demo` and `port demo --lora` (about 40 s on two cores)
def test_the_transcripts_are_fresh() -> None:
    t = _module()
    outputs = {name: t.run(name) for name in t.TRANSCRIPTS}
    assert t.stale(outputs) == [], "run: python docs/transcripts.py"
    edited = {**outputs, "demo": outputs["demo"].replace("PASS", "FAIL", 1)}
    assert t.stale(edited) == ["README.md: demo"]  # the check does see a difference
