"""`port export`'s option values checked without torch, a leaf module: the generic export's dtype, and a
`--target ryzenai` export's opset and profile (static sizes, text length, int4 block size). `port export` refuses a
wrong one before it loads any model library."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from porting.errors import PortError, UsageError

OPSET = 17  # what --target ryzenai writes (Ryzen AI's recommended opset)
DEFAULT_SIZE = 1024
DEFAULT_TEXT_LEN = 512
DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class Profile:
    """The static shapes and int4 settings of a ryzenai export. `size` is the first (or only) image size;
    `more_sizes` the others when `--size` is given several times (one transformer / VAE decoder graph per size, all
    reading one weights file)."""

    size: int = DEFAULT_SIZE
    text_len: int = DEFAULT_TEXT_LEN
    block_size: int = DEFAULT_BLOCK_SIZE
    accuracy_level: int | None = None
    more_sizes: tuple[int, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.size, *self.more_sizes)


def check_profile(size: int | Sequence[int], text_len: int, block_size: int, accuracy_level: int | None) -> Profile:
    """The ryzenai options, or UsageError (exit 2) naming the one that is wrong. `size`: one image size or several
    (`--size` given several times: one static graph per size, in the order given, no repeats)."""
    sizes = [size] if isinstance(size, int) else list(size)
    if not sizes:
        raise UsageError("--size: at least one image size is needed.")
    for name, value in [("--size", s) for s in sizes] + [("--text-len", text_len), ("--block-size", block_size)]:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{name} {value!r}: an integer is needed.")
    for s in sizes:
        if s < 16 or s % 16:
            raise UsageError(f"--size {s}: a multiple of 16 (the VAE's 8x and the 2x2 patches), at least 16.")
    repeated = sorted({s for s in sizes if sizes.count(s) > 1})
    if repeated:
        raise UsageError(f"--size {repeated[0]} is given twice; each size makes one graph.",
                         hint="Give each --size once.")
    if text_len < 1:
        raise UsageError(f"--text-len {text_len}: at least 1.")
    if block_size < 16 or block_size & (block_size - 1):
        raise UsageError(f"--block-size {block_size}: MatMulNBits takes a power of two, at least 16 (default 128).")
    if accuracy_level is not None and accuracy_level not in (0, 1, 2, 3, 4):
        raise UsageError(f"--accuracy-level {accuracy_level}: onnxruntime's MatMulNBits takes 0 to 4 (0: unset, "
                         "1: fp32, 2: fp16, 3: bf16, 4: int8 compute).")
    return Profile(sizes[0], text_len, block_size, accuracy_level, tuple(sizes[1:]))


BF16_REFUSAL = ("--dtype bf16: onnxruntime's CPU execution provider has no bf16 kernels (bf16 Mul fails to load), "
                "so a bf16 export cannot be validated or run on CPU.")
BF16_HINT = "Use --dtype fp16 (half the size, runs on every provider) or fp32."


def check_dtype(dtype: str) -> None:
    """The generic export's --dtype: fp32 or fp16 (bf16 refused: no CPU kernels in onnxruntime)."""
    if dtype == "bf16":
        raise PortError(BF16_REFUSAL, hint=BF16_HINT)
    if dtype not in ("fp32", "fp16"):
        raise PortError(f"--dtype {dtype!r}: choose fp32 or fp16.")


def check_ryzenai_opset(opset: object) -> int:
    """--target ryzenai writes opset 17 exactly (the graph is rewritten down to 17 after tracing)."""
    if opset is not None and (isinstance(opset, bool) or opset != OPSET):
        raise UsageError(f"--opset {opset!r}: --target ryzenai writes opset {OPSET} exactly (Ryzen AI's "
                         "recommended opset).", hint="Leave --opset out with --target ryzenai.")
    return OPSET
