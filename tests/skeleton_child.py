"""Run in a fresh interpreter by tests/test_skeleton.py (`python -m tests.skeleton_child CASE`), so that the import
order is a real command's: build a model skeleton first, through a path that builds without memory, then run diffusers'
BFL-scheme quantize / dequantize, whose E2M1 lookup table `diffusers/quantizers/bfl/utils.py` makes at import. Prints
one JSON object: the table's device, the skeleton's parameter count, the peak RSS the build added, and the
dequantization's relative errors."""

from __future__ import annotations

import json
import resource
import sys

import torch


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _count_meta() -> int:
    """The export's parameter counter at klein-9B size, the diffusers class first looked up inside the build (as a
    counter that names its class lazily does): the first import of diffusers' quantizers happens there."""
    import diffusers

    from porting.demo.tiny import REAL_FLUX2
    from porting.families.export_spec import count_meta

    config = {k: v for k, v in REAL_FLUX2["klein-9b"].items() if not k.startswith("_")}
    return count_meta(lambda: diffusers.Flux2Transformer2DModel.from_config(config))


def _text_encoder() -> int:
    """The export's text-encoder counter's build at Qwen3-8B size (33 GB in float32, the embedding 2.5 GB alone)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from porting.demo.tiny import REAL_QWEN3
    from porting.families.export_spec import count_meta

    return count_meta(lambda: Qwen3ForCausalLM(Qwen3Config(**REAL_QWEN3["qwen3-8b"])))


def _svdq_fixture() -> int:
    """The SVDQuant fixtures' random state (tests/svdqfiles.py), the path that broke the BFL oracle before."""
    from tests.svdqfiles import _full_config, _random_state

    return sum(t.numel() for t in _random_state("flux2", _full_config("flux2"), 0).values())


CASES = {"count_meta": _count_meta, "svdq_fixture": _svdq_fixture}


def main(case: str) -> None:
    before = _peak()
    params = CASES[case]()
    grown = _peak() - before
    text = {}
    if case == "count_meta":  # a second skeleton, the first import of diffusers' quantizers already behind
        before = _peak()
        text = {"text_params": _text_encoder(), "text_peak_growth": _peak() - before}
    from diffusers.quantizers.bfl import utils as bfl

    from tests.quantfiles import diffusers_bfl

    gen = torch.Generator().manual_seed(0)
    state = {"double_blocks.0.img_attn.qkv.weight": torch.randn(48, 64, generator=gen),  # fp8r
             "single_blocks.0.linear1.weight": torch.randn(48, 64, generator=gen)}  # nvfp4: reads the table
    _, oracle = diffusers_bfl(state)
    errors = {k: float((oracle[k] - w).norm() / w.norm()) for k, w in state.items()}
    devices = sorted({t.device.type for t in oracle.values()})
    print(json.dumps({"table_device": bfl.E2M1_LUT.device.type, "oracle_devices": devices, "params": params,
                      "peak_growth": grown, "errors": errors, **text}))


if __name__ == "__main__":
    main(sys.argv[1])
