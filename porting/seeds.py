"""The one seed parser: every verb's seeds (validate --seeds, compare --seeds, generate --seed) are integers in
[0, 2^63), refused by name otherwise (torch's CPU generator cannot take more than a signed 64-bit value)."""

from __future__ import annotations

from porting.errors import UsageError

SEED_LIMIT = 2**63


def check_seed(value: object, option: str = "--seed") -> int:
    """`value` as a seed, or a UsageError (exit 2) naming the option."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{option} {value!r}: seeds are integers (CPU generator seeds), e.g. 0,1,2.")
    if not 0 <= value < SEED_LIMIT:
        raise UsageError(f"{option} {value}: a seed is an integer from 0 to 2^63 - 1 ({SEED_LIMIT - 1}).")
    return value


def parse_seeds(text: str, option: str = "--seeds") -> list[int]:
    """Comma-separated seeds, each checked by check_seed; an empty list or an empty item is refused."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"{option} {text!r}: give one or more comma-separated integers, e.g. 0,1,2.")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"{option} {text!r}: seeds are integers (CPU generator seeds), e.g. 0,1,2.") from None
    return [check_seed(v, option) for v in values]
