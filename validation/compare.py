"""Lock-step comparison: golden, intrinsic reference and device under test advance stage by stage.

For every stage each model runs twice: on its own previous output (accumulated error) and on the golden's input
(teacher-forced: the stage's own error). Errors are relative L2 against the golden; a stage's ratio is the
device's error over the intrinsic error of the same dtype on the reference device.

A device runner that cannot stop between blocks (`localises = False`, e.g. an ONNX graph) is compared on the final
output only: the golden and intrinsic runs still stream stage by stage, and no per-block rows are produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .checks import check_golden_stage
from .metrics import compare, error_ratio
from .runners.base import WHOLE, Runner, forward_all
from .staged import StagedModel, cast_state

GROWTH_FLAG = 1.5  # device error grows this much faster than the reference's through one block


@dataclass
class Runs:
    golden: StagedModel  # always the torch staged run: it also says what each stage is judged by
    intrinsic: Runner
    device: Runner
    # a packed SVDQuant run: the golden computes as the kernel does (4-bit activations) in float32, and `plain`, the
    # float32 run of the dequantized weights, measures per block what the 4-bit computation costs
    plain: Runner | None = None


def whole_output(runs: Runs, inputs: dict[str, Any],
                 on_stage: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The three final outputs, for a device runner without stage boundaries."""
    golden = forward_all(runs.golden, cast_state(inputs, runs.golden.dtype, runs.golden.device), on_stage)
    check_golden_stage("the final output", golden, _where(runs.golden))
    intrinsic = forward_all(runs.intrinsic, inputs)
    (device,) = runs.device.run(WHOLE, [inputs])
    if on_stage:
        on_stage(WHOLE)
    return {"golden": golden, "intrinsic": intrinsic, "device": device["out"]}


def _where(runner: Runner) -> str:
    return f"{str(runner.dtype).removeprefix('torch.')} on {runner.device}"


@dataclass
class Carry:
    """What flows from one stage to the next: the three runs' states and the previous stage's accumulated errors
    (for the growth flag). A pipeline stage boundary (validation.distributed) hands exactly this on."""
    golden: dict[str, Any]
    intrinsic: dict[str, Any]
    device: dict[str, Any]
    prev: dict[str, float] | None = None

    def outputs(self) -> dict[str, torch.Tensor]:
        return {"golden": self.golden["out"], "intrinsic": self.intrinsic["out"], "device": self.device["out"]}


def start(runs: Runs, inputs: dict[str, Any]) -> Carry:
    """The carry entering the first stage: the golden gets the inputs in its dtype, the others take them as built."""
    return Carry(cast_state(inputs, runs.golden.dtype, runs.golden.device), inputs, inputs)


def lockstep(runs: Runs, inputs: dict[str, Any],
             on_stage: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Per-stage metrics and the three final outputs (golden, intrinsic, device); no rows for a whole-graph
    device runner."""
    if not runs.device.localises:
        return [], whole_output(runs, inputs, on_stage)
    rows, carry = lockstep_stages(runs, list(enumerate(runs.golden.stage_names())), start(runs, inputs), on_stage)
    return rows, carry.outputs()


def lockstep_stages(runs: Runs, stages: list[tuple[int, str]], carry: Carry,
                    on_stage: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], Carry]:
    """The lock-step loop over `stages` ((index in the whole model, name), contiguous), from `carry` on.

    The whole model is one call over every stage; a pipeline rank calls it over its own range with the carry it
    received, so the numbers are the same wherever the range boundaries fall."""
    dtype = runs.device.dtype
    stage_input, stage_output = runs.golden.stage_input, runs.golden.stage_output
    golden_state, intrinsic_state, device_state, prev = carry.golden, carry.intrinsic, carry.device, carry.prev
    rows: list[dict[str, Any]] = []
    for index, stage in stages:
        (g_out,) = runs.golden.run(stage, [golden_state])
        if index == 0:  # same inputs for both runs: teacher forcing is the accumulated run
            i_acc, = runs.intrinsic.run(stage, [intrinsic_state])
            d_acc, = runs.device.run(stage, [device_state])
            i_tf, d_tf = i_acc, d_acc
        else:
            i_acc, i_tf = runs.intrinsic.run(stage, [intrinsic_state, golden_state])
            d_acc, d_tf = runs.device.run(stage, [device_state, golden_state])
        golden_t = stage_output(stage, g_out)
        check_golden_stage(stage, golden_t, _where(runs.golden))  # nothing to measure against: stop here
        m = {name: compare(stage_output(stage, st), golden_t, dtype)
             for name, st in (("i_acc", i_acc), ("d_acc", d_acc))}
        # A block adds a small update to a large residual stream; judging the update itself keeps a wrong branch
        # from hiding behind the residual it is added to.
        residual = stage_input(stage, golden_state)
        if residual is None:
            m.update({name: compare(stage_output(stage, st), golden_t, dtype)
                      for name, st in (("i_tf", i_tf), ("d_tf", d_tf))})
        else:
            base = residual.to("cpu", torch.float64)
            update = golden_t.to("cpu", torch.float64) - base
            m.update({name: compare(stage_output(stage, st).to("cpu", torch.float64) - base, update, dtype)
                      for name, st in (("i_tf", i_tf), ("d_tf", d_tf))})
        if runs.plain is not None:
            (p_tf,) = runs.plain.run(stage, [golden_state])
            plain_t = stage_output(stage, p_tf)
            if residual is None:
                m["quant"] = compare(golden_t, plain_t, dtype)
            else:
                m["quant"] = compare(golden_t.to("cpu", torch.float64) - base,
                                     plain_t.to("cpu", torch.float64) - base, dtype)
        row = {
            "stage": stage,
            "accumulated": {"device": m["d_acc"], "intrinsic": m["i_acc"],
                            "ratio": error_ratio(m["d_acc"]["rel_l2"], m["i_acc"]["rel_l2"], dtype)},
            "teacher_forced": {"device": m["d_tf"], "intrinsic": m["i_tf"],
                               "ratio": error_ratio(m["d_tf"]["rel_l2"], m["i_tf"]["rel_l2"], dtype)},
            "growth_flag": False,
            **({"quantization": m["quant"]} if "quant" in m else {}),
        }
        cur = {"d": m["d_acc"]["rel_l2"], "i": m["i_acc"]["rel_l2"]}
        if prev and stage != "final" and all(v > 0 and math.isfinite(v) for v in (*cur.values(), *prev.values())):
            row["growth"] = {"device": cur["d"] / prev["d"], "intrinsic": cur["i"] / prev["i"]}
            row["growth_flag"] = row["growth"]["device"] > GROWTH_FLAG * row["growth"]["intrinsic"]
        prev = cur
        rows.append(row)
        golden_state, intrinsic_state, device_state = g_out, i_acc, d_acc
        if on_stage:
            on_stage(stage)
    return rows, Carry(golden_state, intrinsic_state, device_state, prev)
