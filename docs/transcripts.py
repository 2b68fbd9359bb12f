"""Refresh the command transcripts in README.md and docs/*.md from real runs, or check that they are not stale.

    python docs/transcripts.py            # rerun each command and rewrite its transcript blocks
    python docs/transcripts.py --check    # exit 1 naming each block whose deterministic parts differ

A transcript block sits between `<!-- transcript: NAME -->` and `<!-- /transcript -->` and holds a fenced block with
what `port ARGS` printed (NAME in TRANSCRIPTS), run in a new empty folder, piped, at 80 columns, as a new user would
run it. The check compares everything but what changes from run to run (times in seconds, report folder times).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRANSCRIPTS: dict[str, list[str]] = {"demo": ["demo"], "demo-lora": ["demo", "--lora"]}
BLOCK = re.compile(r"(<!-- transcript: (?P<name>[\w-]+) -->\n```\n)(?P<body>.*?)(```\n<!-- /transcript -->)", re.S)
VARYING = [(re.compile(r"\d+\.\d+ s/it"), "N s/it"), (re.compile(r"\d+\.\d+ s\b"), "N s"),
           (re.compile(r"\d{8}-\d{6}(-\d+)?"), "TIME")]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run(name: str) -> str:
    """What `port ARGS` prints (stdout) for transcript `name`, in a new empty folder, piped, at 80 columns."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    with tempfile.TemporaryDirectory(prefix="flux-port-transcript-") as cwd:
        done = subprocess.run([sys.executable, "-m", "porting", *TRANSCRIPTS[name]], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"port {' '.join(TRANSCRIPTS[name])} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def normalised(text: str) -> str:
    for pattern, replacement in VARYING:
        text = pattern.sub(replacement, text)
    return text


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, body) of every transcript block in a document."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def stale(outputs: dict[str, str]) -> list[str]:
    """`path: name` of every block whose deterministic parts differ from `outputs` (name -> fresh output)."""
    found = []
    for doc in documents():
        for name, body in blocks(doc.read_text(encoding="utf-8")):
            if name in outputs and normalised(body) != normalised(outputs[name]):
                found.append(f"{doc.relative_to(ROOT)}: {name}")
    return found


def refresh(outputs: dict[str, str]) -> list[Path]:
    written = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: m[1] + outputs.get(m["name"], m["body"]) + m[4], text)
        if new != text:
            doc.write_text(new, encoding="utf-8")
            written.append(doc)
    return written


def used() -> list[str]:
    names = {name for doc in documents() for name, _ in blocks(doc.read_text(encoding="utf-8"))}
    unknown = names - set(TRANSCRIPTS)
    if unknown:
        raise SystemExit(f"transcript block(s) name no command: {', '.join(sorted(unknown))}")
    return sorted(names)


def main(argv: list[str]) -> int:
    outputs = {name: run(name) for name in used()}
    if "--check" in argv:
        found = stale(outputs)
        for line in found:
            print(f"stale transcript: {line} (python docs/transcripts.py refreshes it)", file=sys.stderr)
        return 1 if found else 0
    for doc in refresh(outputs):
        print(f"refreshed {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
