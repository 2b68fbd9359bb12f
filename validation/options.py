"""Validation options checked before any work: a degenerate option must be refused, never judged as the model's
fault or passed vacuously (an empty seed list, a zero-size image, a NaN threshold)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from porting.errors import Applies, PortError, Refusal, UsageError, refuse_inapplicable
from porting.seeds import check_seed, parse_seeds  # noqa: F401  (validate's --seeds)

RUNTIMES = ("torch", "onnxruntime")
DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp64")  # --dtype / --golden-dtype (validation.verdict.DTYPES' names)
INTRINSICS = ("native", "emulated")


def check_names(*, runtime: str, devices: Any, dtype: str | None, golden_dtype: str | None,
                intrinsic: str | None) -> None:
    """--runtime, --dtype, --golden-dtype and --intrinsic are values validate knows (exit 2 naming the option)."""
    if runtime not in RUNTIMES and devices is None:
        raise PortError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    for option, name in (("--dtype", dtype), ("--golden-dtype", golden_dtype)):
        if name is not None and name not in DTYPE_NAMES:
            raise PortError(f"{option} {name!r} is not one of {', '.join(DTYPE_NAMES)}.")
    if intrinsic not in (None, *INTRINSICS):
        raise PortError(f"--intrinsic {intrinsic!r}: use native or emulated.")


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


_EVERY = frozenset({"torch", "devices", "onnxruntime"})

# option -> the runs it applies to, checked in this order by `port validate` and `validate()`. Kinds
# (`validate_kind`): torch (one device), devices (torch pipeline stages over several) and onnxruntime (an export).
APPLIES: dict[str, Applies] = {
    "--device": Applies(frozenset({"torch", "onnxruntime"}), Refusal(
        "--devices {devices} with --device {device}: give the devices once, in --devices (several) or --device "
        "(one).")),
    "--ort-threads": Applies(frozenset({"onnxruntime"}), Refusal(
        "--ort-threads {ort_threads}: only with --runtime onnxruntime.",
        "Leave --ort-threads out, or validate an ONNX export with --runtime onnxruntime.", usage=False)),
    "--svdq-compute": Applies(frozenset({"torch"}), Refusal(
        "--svdq-compute runs the packed linears in the torch staged runner on one device; drop --devices / "
        "--runtime onnxruntime, or --svdq-compute.")),
    "--devices": Applies(frozenset({"devices"}), Refusal(
        "--devices with --runtime {runtime}: a pipeline over several devices runs the torch staged runner; drop "
        "one of them.", usage=False)),
    "hooks": Applies(frozenset({"torch", "devices"}), Refusal(
        "weight transforms and model hooks act on a torch model; the onnxruntime runner has none.", usage=False)),
    "--text-encoder": Applies(frozenset({"torch"}), Refusal(
        "--text-encoder encodes --prompt in the torch staged runner on one device; drop --devices / --runtime "
        "onnxruntime, or --text-encoder.", usage=False), needs={"torch": ("--prompt", Refusal(
            "--text-encoder encodes --prompt: give --prompt (and --base, whose encoder it stands in for).",
            usage=False))}),
    "--prompt": Applies(_EVERY, Refusal(""), needs={kind: ("--base", Refusal(
        "--prompt needs --base (the base model's text encoder encodes it).", usage=False)) for kind in _EVERY}),
}


def validate_kind(runtime: str, devices: Any) -> str:
    """The kind `APPLIES` knows: the runtime when it is not torch, else devices (several) or torch (one)."""
    if runtime != "torch":
        return runtime
    return "devices" if devices is not None else "torch"


def check_applicable(runtime: str, given: Mapping[str, Any], **fields: Any) -> None:
    """Refuse (exit 2) the first option of `APPLIES` that `given` names (not None) where it does not apply.
    `fields`: the option values the messages name (device, devices, runtime, ort_threads)."""
    shown = {option: None if value is None else option for option, value in given.items()}
    refuse_inapplicable(APPLIES, validate_kind(runtime, given.get("--devices")), shown, runtime=runtime, **fields)
