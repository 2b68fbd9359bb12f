"""A validation that cannot fail does not pass: the cases where nothing would be measured, refused with exit 2.

- the device run, the intrinsic run and the golden are one computation (`--dtype fp32` against a fp32 golden on the
  same device): refused before any work;
- the golden holds NaN/Inf (in a weight, or in what a stage computes): there is nothing to measure against;
- the golden's output is all zeros (an all-zero model), or the device's and the intrinsic run's errors are both
  exactly 0: any device would pass;
- the intrinsic run is not finite while the device's is: the ratio has no denominator (device / inf = 0);
- a quantized source whose dequantized weights hold an all-zero or non-finite layer: the golden runs on those same
  weights, so the comparison cannot see it; flagged by name before validation.
"""

from __future__ import annotations

from typing import Any

import torch

from porting.errors import UsageError

from .weights import WeightSource

SHOWN = 5  # tensor names listed in a message


class Unmeasurable(UsageError):
    """Validation would measure nothing (exit 2): a report would say PASS whatever the device computed."""


def _names(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def check_not_one_computation(*, dtype: str, golden_dtype: str, device: Any, reference: Any, runtime: str) -> None:
    """Refuse up front a run whose device, intrinsic and golden runs are the same arithmetic on the same device."""
    if runtime == "torch" and dtype == golden_dtype and device == reference:
        raise Unmeasurable(
            f"--dtype {dtype} against a {golden_dtype} golden on {reference}: the device run, the intrinsic run and "
            "the golden would be one computation, so both errors would be exactly 0 and any model would pass.",
            hint=f"Judge {dtype} against a more precise golden: --golden-dtype fp64.")


class GoldenWeights:
    """The golden's weight transform: passes every tensor through unchanged, refuses a non-finite one by name and
    counts all-zero ones (for the message when the golden computes nothing)."""

    def __init__(self) -> None:
        self.seen = 0
        self.zero: list[str] = []

    def __call__(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad = int((~finite).sum())
                raise Unmeasurable(f"weight {key} holds {bad} NaN/Inf value(s) of {tensor.numel()}: the golden would "
                                   "be non-finite, and there is nothing to measure the device against.",
                                   hint="Fix or re-download the checkpoint; port inspect / convert name the file.")
            if not bool(tensor.any()):
                self.zero.append(key)
        return tensor


def check_golden_stage(stage: str, golden: torch.Tensor, where: str) -> None:
    """Stop at the first stage whose golden output is not finite (finite weights, overflowing activations)."""
    finite = torch.isfinite(golden)
    if not bool(finite.all()):
        raise Unmeasurable(f"the golden ({where}) computes NaN/Inf in {stage} ({int((~finite).sum())} of "
                           f"{golden.numel()} values): there is nothing to measure the device against.",
                           hint="The weights overflow even in the golden's dtype; check the checkpoint (port "
                                "inspect) or try --golden-dtype fp64.")


def check_measurable(golden: torch.Tensor, device_metrics: dict[str, Any], intrinsic_metrics: dict[str, Any], *,
                     dtype: str, golden_dtype: str, weights: GoldenWeights | None) -> None:
    """After the runs, before a verdict: refuse a comparison that any device would pass."""
    if not bool(golden.any()):
        zero = (f" {len(weights.zero)} of the {weights.seen} weight tensors are all zero"
                + (" (an all-zero model)" if weights.zero and len(weights.zero) == weights.seen else "") + "."
                if weights is not None and weights.seen else "")
        raise Unmeasurable("the golden's output (stage final) is all zeros: the model computes nothing, so any "
                           f"device would pass.{zero}", hint="Validate the trained weights, not an empty model.")
    if device_metrics["rel_l2"] == 0 and intrinsic_metrics["rel_l2"] == 0:
        raise Unmeasurable(f"the device's and the intrinsic {dtype} run's errors against the {golden_dtype} golden "
                           "are both exactly 0 at the final output: the runs computed the golden's own numbers, so "
                           "the check could not fail.",
                           hint="Judge against a more precise golden (--golden-dtype fp64) or a lower --dtype.")
    if intrinsic_metrics["nonfinite"] and not device_metrics["nonfinite"]:
        raise Unmeasurable(f"the intrinsic {dtype} run computes NaN/Inf ({intrinsic_metrics['nonfinite']} value(s) in "
                           "the final output) while the device's is finite: the ratio has no denominator.",
                           hint=f"The model overflows in {dtype} on the reference device; validate in another "
                                "--dtype, or with --intrinsic emulated.")


def check_dequantized(source: WeightSource) -> None:
    """A quantized source (or a folder converted from one): every dequantized weight finite, no all-zero layer."""
    provenance = source.provenance()
    label = provenance.get("dequantized_from")
    if not label:
        return
    nonfinite, zero = [], []
    for key in source.keys():
        tensor = source.get(key)
        if not tensor.is_floating_point():
            continue
        if not bool(torch.isfinite(tensor).all()):
            nonfinite.append(key)
        elif tensor.ndim >= 2 and not bool(tensor.any()):
            zero.append(key)
    if nonfinite or zero:
        what = "; ".join(part for part in (
            f"NaN/Inf in {_names(nonfinite)}" if nonfinite else "",
            f"all-zero layer(s) {_names(zero)}" if zero else "") if part)
        raise Unmeasurable(f"{source.path}: the weights dequantized from {label} hold {what}. The golden runs on "
                           "these same dequantized weights, so validation could not see the fault.",
                           hint="The quantized file (or its scales) is damaged; re-download or re-quantize it.")
