"""The pipeline verbs' option values that need no model (generate, compare, bench): sizes, offload modes, tasks and
run counts, parsed and refused here, a leaf module without torch, so that `port` refuses them before it loads any
model library."""

from __future__ import annotations

from typing import Sequence

from porting.errors import InputError, PortError

OFFLOADS = ("none", "model", "sequential", "group")
TASKS = ("t2i", "edit")


def parse_size(text: str | int) -> tuple[int, int]:
    """'1024' or '768x1024' (width x height)."""
    s = str(text).lower().strip()
    try:
        w, _, h = s.partition("x")
        width, height = int(w), int(h or w)
    except ValueError as e:
        raise PortError(f"--size {text!r}: use one number (1024) or WIDTHxHEIGHT (768x1024).") from e
    if width <= 0 or height <= 0:
        raise PortError(f"--size {text!r}: sides must be positive.")
    return width, height


def parse_list(text: str, option: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise InputError(f"{option} {text!r}: give a comma-separated list.")
    return items


def check_choices(modes: Sequence[str], tasks: Sequence[str], runs: int, warmup: int) -> tuple[list[str], list[str]]:
    """bench's offload modes and tasks, each once in the order given; refuses unknown ones and empty lists."""
    modes, tasks = list(dict.fromkeys(modes)), list(dict.fromkeys(tasks))
    for m in modes:
        if m not in OFFLOADS:
            raise PortError(f"--offload {m!r}: choose from {', '.join(OFFLOADS)}.")
    for t in tasks:
        if t not in TASKS:
            raise PortError(f"--task {t!r}: choose from {', '.join(TASKS)}.")
    if not modes or not tasks:
        raise PortError("--offload and --task need at least one value each.")
    if runs < 1 or warmup < 0:
        raise PortError(f"--runs {runs} / --warmup {warmup}: at least one timed run, no negative warm-up.")
    return modes, tasks
