"""Numerical equivalence, not just names: converted weights compute what the original model computes.

Random tiny weights in original naming run through the independent references in tests/reference/ (written from
the math in flux2-checkpoints.md, torch only). The same file goes through `port convert --strict`, the output
folder is loaded strictly into the diffusers class, and both forward passes on identical inputs must agree within
1e-5 in float32. A negative control (the final-layer swap removed from a copy of the table) must fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

from porting.engine.convert import convert
from porting.families.mapping import load_table_file

from .helpers import (
    REAL1,
    REAL2,
    TINY1_DEV,
    TINY1_SCHNELL,
    TINY2,
    TINY2_GUIDANCE,
    compare_outputs,
    meta_shapes,
    reference_model,
    run_port,
    save_state,
)
from .reference import flux1_bfl, flux2_bfl

TOL = 1e-5
MAPPINGS = Path(__file__).resolve().parents[1] / "mappings"


def load_strict(cls, folder: Path):
    """from_pretrained with the loading report: no missing, unexpected or mis-shaped key is tolerated."""
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    assert info["mismatched_keys"] == [] and info["error_msgs"] == [], info
    return model.eval()


def flux2_inputs(params, batch=2, seed=0):
    """Latents of a 3x4 image plus a 2x2 reference image at t = 10 (section 6 item 5), 5 text tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([flux2_bfl.image_ids(batch, 3, 4), flux2_bfl.image_ids(batch, 2, 2, t=10)], dim=1)
    return {
        "x": torch.randn(batch, ids.shape[1], params.in_channels, generator=gen), "x_ids": ids,
        "ctx": torch.randn(batch, 5, params.context_dim, generator=gen), "ctx_ids": flux2_bfl.text_ids(batch, 5),
        "timesteps": torch.tensor([0.25, 0.9])[:batch],
        "guidance": torch.tensor([4.0, 2.5])[:batch] if params.guidance else None,
    }


def run_flux2_pair(reference, model, inp) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        ref = reference(**inp)
        # diffusers: the same t in [0, 1] (it multiplies by 1000 itself), ids without the batch dim (section 6.12)
        out = model(hidden_states=inp["x"], encoder_hidden_states=inp["ctx"], timestep=inp["timesteps"],
                    img_ids=inp["x_ids"][0], txt_ids=inp["ctx_ids"][0], guidance=inp["guidance"]).sample
    return ref, out


@pytest.mark.parametrize("params", [TINY2, TINY2_GUIDANCE], ids=["klein-like (no guidance)", "dev-like (guidance)"])
def test_flux2_converted_weights_compute_the_reference_output(tmp_path, capsys, params):
    reference = reference_model(params, seed=3)
    src = save_state(tmp_path / "bfl.safetensors", reference.state_dict())
    run = run_port(capsys, "convert", src, "--out", tmp_path / "transformer", "--strict", "--quiet")
    assert run.code == 0, run.err
    model = load_strict(Flux2Transformer2DModel, tmp_path / "transformer")
    assert model.config.guidance_embeds == params.guidance
    ref, out = run_flux2_pair(reference, model, flux2_inputs(params))
    assert ref.abs().max() > 0.5  # a meaningful output, not a collapsed one
    assert (ref - out).abs().max().item() <= TOL, compare_outputs(ref, out)


def test_flux2_negative_control_without_final_layer_swap_fails(tmp_path):
    """The same check on a table whose final-layer swap_halves was removed must see a large error."""
    text = (MAPPINGS / "flux2.toml").read_text()
    swap = 'op = { name = "swap_halves", dim = 0 }\n'
    assert text.count(swap) == 1
    broken = load_table_file(_write(tmp_path / "flux2-noswap.toml", text.replace(swap, "")))
    reference = reference_model(TINY2, seed=3)
    src = save_state(tmp_path / "bfl.safetensors", reference.state_dict())
    # still a complete, strict plan: only the numbers are wrong
    convert(src, tmp_path / "broken", strict=True, tables={"flux2": broken})
    convert(src, tmp_path / "good", strict=True)
    inp = flux2_inputs(TINY2)
    ref, good = run_flux2_pair(reference, load_strict(Flux2Transformer2DModel, tmp_path / "good"), inp)
    _, bad = run_flux2_pair(reference, load_strict(Flux2Transformer2DModel, tmp_path / "broken"), inp)
    assert (ref - good).abs().max().item() <= TOL
    error = (ref - bad).abs().max().item()
    assert error > 1000 * TOL, f"negative control not detected: {compare_outputs(ref, bad)}"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def flux1_inputs(params, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_ids = flux1_bfl.image_ids(batch, 3, 4).clone()
    x_ids[:, ::5, 0] = 1.0  # some tokens off the first axis so all three RoPE axes are exercised
    return {
        "x": torch.randn(batch, 12, params.in_channels, generator=gen), "x_ids": x_ids,
        "ctx": torch.randn(batch, 5, params.context_dim, generator=gen), "ctx_ids": flux1_bfl.text_ids(batch, 5),
        "y": torch.randn(batch, params.vec_in_dim, generator=gen), "timesteps": torch.tensor([0.25, 0.9])[:batch],
        "guidance": torch.tensor([3.5, 1.0])[:batch] if params.guidance else None,
    }


def run_flux1_pair(reference, model, inp) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        ref = reference(**inp)
        out = model(hidden_states=inp["x"], encoder_hidden_states=inp["ctx"], pooled_projections=inp["y"],
                    timestep=inp["timesteps"], img_ids=inp["x_ids"][0], txt_ids=inp["ctx_ids"][0],
                    guidance=inp["guidance"]).sample
    return ref, out


@pytest.mark.parametrize("params", [TINY1_DEV, TINY1_SCHNELL], ids=["FLUX.1-dev-like", "FLUX.1-schnell-like"])
def test_flux1_converted_weights_compute_the_reference_output(tmp_path, capsys, params):
    reference = reference_model(params, seed=4)
    src = save_state(tmp_path / "flux1.safetensors", reference.state_dict())
    run = run_port(capsys, "convert", src, "--out", tmp_path / "transformer", "--strict", "--quiet")
    assert run.code == 0, run.err
    model = load_strict(FluxTransformer2DModel, tmp_path / "transformer")
    assert model.config.guidance_embeds == params.guidance
    assert list(model.config.axes_dims_rope) == [16, 56, 56]
    ref, out = run_flux1_pair(reference, model, flux1_inputs(params))
    assert ref.abs().max() > 0.5
    assert (ref - out).abs().max().item() <= TOL, compare_outputs(ref, out)


# The references' module trees reproduce the published key and parameter counts (flux2-checkpoints.md sections 3
# and 7), so the names they produce are the BFL checkpoint names at every size, not just at tiny size.
@pytest.mark.parametrize("name, keys, params", [
    ("klein-4B", 149, 3_875_544_576), ("klein-9B", 201, 9_078_581_248), ("FLUX.2-dev", 299, 32_223_281_152),
    ("FLUX.1-dev", 780, 11_901_408_320), ("FLUX.1-schnell", 776, 11_891_178_560),
])
def test_reference_trees_have_the_published_sizes(name, keys, params):
    shapes = meta_shapes({**REAL2, **REAL1}[name])
    assert len(shapes) == keys
    assert sum(torch.Size(s).numel() for s in shapes.values()) == params
    assert not any(k.endswith(".bias") for k in shapes) or name.startswith("FLUX.1")
