"""Progress of the long verbs (generate, compare, bench, validate, export) on stderr.

On a terminal: one live bar (rich, transient). Off a terminal (a log, CI, a pipe): one plain line per step, so a
log shows the run advancing. Either way, once the first step is timed, a run whose estimate passes
ESTIMATE_AFTER_S says so before it goes on ("about 12 min for 37 images; the first step took ..."). The libraries'
own bars (diffusers, transformers tqdm) stay silent unless FLUX_PORT_DEBUG=1 (porting.cli._output.quiet_libraries,
and the pipelines' set_progress_bar_config).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from porting.text import for_console

ESTIMATE_AFTER_S = 60.0
clock: Callable[[], float] = time.perf_counter  # the timing source; tests replace it to make a step slow


def debug() -> bool:
    """FLUX_PORT_DEBUG=1: the libraries' own progress bars and logs are shown."""
    return bool(os.environ.get("FLUX_PORT_DEBUG"))


def duration(seconds: float) -> str:
    """12 s, 3 min 20 s, 1 h 05 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{max(seconds, 0):.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def estimate_line(seconds: float, units: int, unit: str) -> str | None:
    """The estimate to print when `units` units of `seconds` each pass ESTIMATE_AFTER_S, else None."""
    whole = seconds * units
    if whole <= ESTIMATE_AFTER_S:
        return None
    return (f"estimate: about {duration(whole)} for {units} {unit}(s) (the first took {duration(seconds)}); "
            "--help lists the options that make it shorter")


class StepProgress:
    """`total` steps of `what` (steps, images, stages): a bar on a terminal, a line per step elsewhere, and the
    estimate after the first timed step when the whole run would pass ESTIMATE_AFTER_S.

    `console` is a rich Console (stderr), or None for a quiet run (no lines, no estimate). `per_step_total` is the
    number of timed units the estimate multiplies (default `total`): compare times one denoising step and multiplies
    by steps x images."""

    def __init__(self, console: Any | None, what: str, total: int, *, unit: str = "step",
                 estimate_units: int | None = None, since: float | None = None) -> None:
        self.console, self.what, self.total, self.unit = console, what, total, unit
        self.estimate_units = estimate_units if estimate_units is not None else total
        self.done = 0
        self.since = since  # the elapsed time counts from here (validate: before loading), else from start()
        self.started: float | None = None
        self.estimated = False
        self._bar: Any = None
        self._task: Any = None

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def __enter__(self) -> StepProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.since is None:
            self.since = clock()
        if self.console is not None and self.console.is_terminal:
            from rich import progress as rp

            self._bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                                    rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), console=self.console,
                                    transient=True)
            self._task = self._bar.add_task(self.what, total=self.total)
            self._bar.start()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # --- events ------------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """A status line above the bar (or a plain line)."""
        if self.console is not None:
            self.console.print(for_console(text, self.console), markup=False, soft_wrap=True, highlight=False)

    def begin_timing(self) -> None:
        """The timed work starts now (the first transformer call); defaults to the first step's start."""
        if self.started is None:
            self.started = clock()

    def timed(self, seconds: float | None = None) -> None:
        """One estimate unit finished (a denoising step, a stage); the first one gives the estimate."""
        if self.estimated or self.console is None:
            return
        now = clock()
        if seconds is None:
            seconds = now - (self.started if self.started is not None else now)
        self.estimated = True
        line = estimate_line(seconds, self.estimate_units, self.unit)
        if line:
            self.say(line)

    def advance(self, label: str = "") -> None:
        """One of `total` finished: the bar moves, or a line is printed."""
        self.done += 1
        if self.console is None:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=f"{self.what} {label}".strip())
            return
        self.say(f"{self.what} {self.done}/{self.total} ({label + '; ' if label else ''}{self.times()})")

    def times(self) -> str:
        """`12 s elapsed, about 30 s left`: the time since the start, and the rest at the pace so far."""
        elapsed = clock() - (self.since if self.since is not None else clock())
        text = f"{duration(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", about {duration(elapsed / self.done * (self.total - self.done))} left"
        return text


class TimedSteps:
    """Steps of unequal size run one after another (export: hashing, then one component after another, each one
    long call): each step is announced with the time so far, its end with its duration and, once a sized step has
    finished, an estimate of the rest from the pace so far (by size: parameters). On a terminal a spinner shows
    the running step's elapsed time; off a terminal each step is one line when it starts and one when it ends.

    Used as the `on_status(text, size=None, left=None)` callback of a verb: `size` is the step's size, `left` the
    size of the sized steps still to come after it."""

    def __init__(self, console: Any | None) -> None:
        self.console = console
        self.since = clock()
        self.current: tuple[str, float, int | None] | None = None
        self.sized_s = 0.0
        self.sized = 0
        self._status: Any = None

    def __call__(self, text: str, size: int | None = None, left: int | None = None) -> None:
        now = clock()
        self.end(now)
        line = f"{text} (at {duration(now - self.since)}"
        if size and self.sized:
            line += f"; about {duration(self.sized_s / self.sized * (size + (left or 0)))} left"
        self.say(line + ")")
        self.current = (text, now, size)
        if self.console is not None and self.console.is_terminal:
            self._status = self.console.status(f"{text} ...")
            self._status.start()

    def end(self, now: float | None = None) -> None:
        """The running step is over (at `now`, else now): its time is said and counts toward the pace."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self.current is None:
            return
        text, began, size = self.current
        now = clock() if now is None else now
        seconds = now - began
        if size:
            self.sized_s += seconds
            self.sized += size
        if seconds >= 1 or size:
            self.say(f"  took {duration(seconds)} ({duration(now - self.since)} in all)")
        self.current = None

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(for_console(text, self.console), markup=False, soft_wrap=True, highlight=False)
