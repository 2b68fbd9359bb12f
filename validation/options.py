"""Validation options checked before any work: a degenerate option must be refused, never judged as the model's
fault or passed vacuously (an empty seed list, a zero-size image, a NaN threshold)."""

from __future__ import annotations

import math
from typing import Sequence

from porting.errors import UsageError
from porting.seeds import check_seed, parse_seeds  # noqa: F401  (validate's --seeds)


def parse_timesteps(text: str) -> list[float]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"--timesteps {text!r}: give one or more comma-separated values in [0, 1], e.g. 1.0,0.5.")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--timesteps {text!r}: expected numbers in [0, 1], e.g. 1.0,0.5,0.1.") from None
    check_timesteps(values)
    return values


def check_timesteps(values: Sequence[float]) -> None:
    if not values:
        raise UsageError("--timesteps: give at least one timestep in [0, 1].")
    bad = [v for v in values if not (math.isfinite(v) and 0.0 <= v <= 1.0)]
    if bad:
        raise UsageError(f"--timesteps {bad[0]!r}: timesteps are flow-matching times in [0, 1].")


def check_options(*, resolution: int, text_len: int, timesteps: Sequence[float], seeds: Sequence[int],
                  max_ratio: float) -> None:
    """Raise UsageError (exit 2) for any option that would make the verdict meaningless."""
    if resolution < 16:
        raise UsageError(f"--resolution {resolution}: needs at least 16 pixels (one latent patch).")
    if text_len < 1:
        raise UsageError(f"--text-len {text_len}: needs at least 1 text token.")
    check_timesteps(timesteps)
    if not seeds:
        raise UsageError("--seeds: give at least one seed.")
    for s in seeds:
        check_seed(s, "--seeds")
    if not (math.isfinite(max_ratio) and max_ratio > 0):
        raise UsageError(f"--max-ratio {max_ratio!r}: a finite ratio above 0 (2 accepts twice the dtype's own "
                         "error).")
