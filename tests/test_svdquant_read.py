"""Reading Nunchaku SVDQuant files: the oracle is deepcompressor's own converter (tests/svdqfiles.py), not our code.

A converted folder must hold exactly the weights the kernel multiplies by (W = R/s + U·D, computed by the fixture
from the converter's inputs), rounded once to bf16; the tiny model run from our folder must equal the model run from
those weights; and every malformed header is refused by the key that is wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .helpers import leftovers, run_port

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from .svdqfiles import write_svdq_file  # noqa: E402

CASES = [
    ("flux2", "int4", dict(spelling="module")),
    ("flux2", "int4", dict(spelling="alias")),
    ("flux2", "nvfp4", dict(spelling="module")),
    ("flux2", "int4", dict(spelling="module", smooth_fused=True)),
    ("flux1", "int4", dict()),
    ("flux1", "nvfp4", dict()),
    ("flux1", "int4", dict(container="split")),
    ("flux1", "nvfp4", dict(smooth_fused=True)),
]


def _ids(case) -> str:
    family, precision, kw = case
    return "-".join([family, precision, *(f"{k}={v}" for k, v in kw.items())])


def _model(config: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import diffusers

    cls = getattr(diffusers, config["_class_name"])
    model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def _inputs(config: dict, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens, text = 16, 8
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    del inner
    out = {"hidden_states": torch.randn(1, tokens, config["in_channels"], generator=gen),
           "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=gen),
           "timestep": torch.tensor([0.5])}
    if family == "flux2":
        out["img_ids"] = torch.stack(torch.meshgrid(torch.zeros(1), torch.zeros(1), torch.arange(4.0),
                                                    torch.arange(4.0), indexing="ij"), -1).reshape(-1, 4)
        out["txt_ids"] = torch.zeros(text, 4)
        out["txt_ids"][:, 3] = torch.arange(text)
    else:
        out["img_ids"] = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                    indexing="ij"), -1).reshape(-1, 3)
        out["txt_ids"] = torch.zeros(text, 3)
        out["pooled_projections"] = torch.randn(1, config["pooled_projection_dim"], generator=gen)
        out["guidance"] = torch.tensor([3.5])
    return out


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_convert_gives_the_kernels_weights_and_the_same_forward(case, tmp_path, capsys):
    family, precision, kw = case
    fx = write_svdq_file(tmp_path / "src", family, precision, **kw)
    out = tmp_path / "out"
    run = run_port(capsys, "convert", fx.path, "--out", out, "--strict", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["dequantized_from"].startswith(f"Nunchaku SVDQuant {precision}, rank {fx.rank}")
    written = load_file(out / "diffusion_pytorch_model.safetensors")
    assert set(written) == set(fx.expected)
    for key, want in fx.expected.items():
        got = written[key]
        assert got.dtype == torch.bfloat16, key
        # W_eff computed in float32 blocks vs the oracle's float64: equal once rounded to bf16, but for a rare
        # element on a rounding boundary (one bf16 ulp) or cancelled to near zero (float32's absolute error)
        diff = (got.float() - want.to(torch.bfloat16).float()).abs()
        ulp = want.abs().to(torch.bfloat16).float() * 2**-7 + 2**-20 * want.abs().max()
        assert bool((diff <= ulp).all()), f"{key}: max diff {diff.max().item()}"
        assert (diff != 0).float().mean().item() < 1e-3, key
    # the same network: the tiny model from our folder equals the model from the oracle's weights
    ours = _model(fx.config, {k: v.float() for k, v in written.items()})
    theirs = _model(fx.config, {k: v.to(torch.bfloat16).float() for k, v in fx.expected.items()})
    inputs = _inputs(fx.config, family)
    with torch.no_grad():
        a, b = ours(**inputs, return_dict=False)[0], theirs(**inputs, return_dict=False)[0]
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 1e-3, rel
    # and it is 4-bit noise away from the original weights, not something else
    with torch.no_grad():
        c = _model(fx.config, fx.original)(**inputs, return_dict=False)[0]
    assert 1e-4 < ((a - c).norm() / c.norm()).item() < 0.5


def test_diffusers_loads_the_folder(tmp_path, capsys):
    import diffusers

    fx = write_svdq_file(tmp_path / "src", "flux2", "int4")
    assert run_port(capsys, "convert", fx.path, "--out", tmp_path / "out", "--strict").code == 0
    model = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "out")
    assert model.config.num_attention_heads == 2


def test_to_original_and_back_is_the_same_bf16(tmp_path, capsys):
    fx = write_svdq_file(tmp_path / "src", "flux2", "nvfp4", spelling="alias")
    assert run_port(capsys, "convert", fx.path, "--out", tmp_path / "d", "--strict").code == 0
    assert run_port(capsys, "convert", fx.path, "--to", "original", "--out", tmp_path / "o", "--strict").code == 0
    original = next((tmp_path / "o").glob("*.safetensors"))
    assert run_port(capsys, "convert", original, "--out", tmp_path / "d2", "--strict").code == 0
    a = load_file(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "d2" / "diffusion_pytorch_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_quantize_to_gguf_from_svdquant(tmp_path, capsys):
    fx = write_svdq_file(tmp_path / "src", "flux2", "int4")
    run = run_port(capsys, "convert", fx.path, "--to", "original", "--quantize", "gguf-q8_0", "--out", tmp_path / "g")
    assert run.code == 0, run.err
    assert list((tmp_path / "g").glob("*.gguf"))


@pytest.mark.parametrize("family,precision,spelling", [("flux2", "int4", "module"), ("flux2", "nvfp4", "alias"),
                                                       ("flux1", "int4", "module"), ("flux1", "nvfp4", "module")])
def test_inspect_names_the_format_from_the_header_alone(family, precision, spelling, tmp_path):
    fx = write_svdq_file(tmp_path / "src", family, precision, spelling=spelling)
    code = ("import json, sys\nfrom porting.cli.app import main\n"
            f"try:\n    main(['inspect', {str(fx.path)!r}, '--json'])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(json.dumps({'torch': 'torch' in sys.modules}), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == {"torch": False}
    doc = json.loads(proc.stdout)
    details = doc["quantization"]["details"]
    assert doc["family"] == family and doc["naming"] == "diffusers"
    assert details["precision"] == precision and details["rank"] == fx.rank
    assert details["group_size"] == (64 if precision == "int4" else 16)
    w4a16 = 3 if family == "flux1" else 0  # FLUX.1: norm1, norm1_context, single norm (AWQ); FLUX.2: none
    assert details["w4a16_layers"] == w4a16
    w4a4 = 8 + 4 if family == "flux2" else 8 + 4
    assert details["w4a4_layers"] == w4a4
    if family == "flux2":
        assert details["spelling"] == spelling
    assert doc["variant"].endswith(family)


def test_split_pair_folder_is_one_checkpoint(tmp_path, capsys):
    fx = write_svdq_file(tmp_path / "src", "flux1", "int4", container="split")
    run = run_port(capsys, "inspect", fx.path, "--json")
    assert run.code == 0, run.err
    assert json.loads(run.out)["quantization"]["details"]["w4a16_layers"] == 3


# --- refusals: each names the key that is wrong, nothing written -----------------------------------------

def _rewrite(src: Path, dst: Path, *, drop: str | None = None, metadata: dict | None = None,
             replace: dict | None = None) -> Path:
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    meta.update(metadata or {})
    save_file(tensors, str(dst), metadata=meta)
    return dst


def _refused(capsys, path: Path, out: Path, *needles: str, code: int = 2) -> None:
    """Exit 2 for a damaged or inconsistent file (docs/exit-codes.md), 1 for a layout flux-port refuses."""
    run = run_port(capsys, "convert", path, "--out", out)
    assert run.code == code, (run.code, run.err)
    for needle in needles:
        assert needle in run.msg, (needle, run.msg)
    assert leftovers(out) == []


@pytest.fixture(scope="module")
def flux2_file(tmp_path_factory):
    return write_svdq_file(tmp_path_factory.mktemp("svdq"), "flux2", "int4")


def test_unknown_precision_is_refused(flux2_file, tmp_path, capsys):
    qc = json.loads(flux2_file.metadata["quantization_config"])
    qc["weight"]["dtype"] = "int3"
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", metadata={"quantization_config": json.dumps(qc)})
    _refused(capsys, bad, tmp_path / "out", "quantization_config", "'int3'", code=1)


def test_group_size_the_precision_does_not_allow_is_refused(flux2_file, tmp_path, capsys):
    qc = json.loads(flux2_file.metadata["quantization_config"])
    qc["weight"]["group_size"] = 128
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", metadata={"quantization_config": json.dumps(qc)})
    _refused(capsys, bad, tmp_path / "out", "quantization_config", "group_size 128")


def test_a_layer_missing_its_scales_is_refused(flux2_file, tmp_path, capsys):
    key = "transformer_blocks.0.ff.linear_in.wscales"
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", drop=key)
    _refused(capsys, bad, tmp_path / "out", "transformer_blocks.0.ff.linear_in", "wscales")


def test_rank_disagreeing_with_metadata_is_refused(flux2_file, tmp_path, capsys):
    qc = json.loads(flux2_file.metadata["quantization_config"])
    qc["rank"] = 32
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", metadata={"quantization_config": json.dumps(qc)})
    _refused(capsys, bad, tmp_path / "out", "rank 16", "rank 32", "proj_down")


def test_dimension_not_a_multiple_of_128_is_refused(flux2_file, tmp_path, capsys):
    prefix = "transformer_blocks.0.attn.to_add_out."
    with safe_open(str(flux2_file.path), "pt") as f:
        q = f.get_tensor(prefix + "qweight")
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors",
                   replace={prefix + "qweight": q[:, : q.shape[1] - 16].contiguous()})
    _refused(capsys, bad, tmp_path / "out", "transformer_blocks.0.attn.to_add_out", "multiple of 128")


def test_nonzero_bias_flux2_cannot_carry_is_refused(flux2_file, tmp_path, capsys):
    key = "transformer_blocks.0.attn.to_out.0.bias"
    with safe_open(str(flux2_file.path), "pt") as f:
        bias = f.get_tensor(key)
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", replace={key: torch.ones_like(bias)})
    _refused(capsys, bad, tmp_path / "out", key, "not all zeros")


def test_packed_layers_outside_the_blocks_are_refused(flux2_file, tmp_path, capsys):
    """E.g. a 4-bit text encoder: no public code establishes its layout, so it is refused by name."""
    with safe_open(str(flux2_file.path), "pt") as f:
        q = f.get_tensor("transformer_blocks.0.attn.to_out.0.qweight")
        s = f.get_tensor("transformer_blocks.0.attn.to_out.0.wscales")
    bad = tmp_path / "svdq-int4-Qwen3-text.safetensors"
    save_file({"model.layers.0.self_attn.o_proj.qweight": q, "model.layers.0.self_attn.o_proj.wscales": s}, str(bad))
    _refused(capsys, bad, tmp_path / "out", "model.layers.0.self_attn.o_proj", "SVDQuant", code=1)


# --- validation sees a corrupted packed tile and names its block ---------------------------------------------------

@pytest.mark.parametrize("compute", ["w4a4", pytest.param("w4a16", marks=pytest.mark.slow)])
def test_a_corrupted_packed_tile_fails_validation_in_its_block(compute, tmp_path):
    """The device run gets the codes of a copy of the file with one 128x64 qweight tile flipped (tests/svdqfiles
    `corrupt_tile`, in the file's own MMA layout); the reference runs the intact file. Validation must fail and
    blame the block holding that tile, with the blocks before it clean."""
    import shutil

    from porting.runtime.svdq_linear import PackedPiece
    from porting.tensors.quant.svdq import tiles as P
    from validation.api import validate

    from .svdqfiles import corrupt_tile

    fx = write_svdq_file(tmp_path / "src", "flux2", "int4", spelling="module")
    layer = "single_transformer_blocks.0.attn.mlp_fc1."
    broken = shutil.copy(fx.path, tmp_path / "broken.safetensors")
    corrupt_tile(Path(broken), layer + "qweight")
    with safe_open(str(broken), "pt") as f:
        q = f.get_tensor(layer + "qweight")
    codes = P.unpack_code_bytes(q, q.shape[0], q.shape[1] * 2)

    def use_broken_codes(model: torch.nn.Module) -> None:
        block = model.get_submodule("single_transformer_blocks.0")

        def swap(module, args):  # the stage's packed linears exist once it is materialised, before it runs
            for piece in module.modules():
                if isinstance(piece, PackedPiece) and piece.prefix == layer:
                    piece.codes.copy_(codes.to(piece.codes.device))
        block.register_forward_pre_hook(swap)

    d = validate(fx.path, svdq_compute=compute, prepare_device_model=use_broken_codes, resolution=128,
                 text_len=32).to_dict()
    assert d["verdict"] == "fail"
    assert d["blame"]["stage"] == "single_transformer_blocks.0"
    assert all(b["teacher_forced"]["ratio"] <= 2.0 for b in d["blocks"] if b["stage"] == "transformer_blocks.0")


def test_published_card_says_what_it_was_dequantized_from(tmp_path, capsys):
    """SVDQuant file -> convert -> validate -> publish: the manifest and the model card name the source format."""
    from porting.demo.bases import write_tiny_base

    base = write_tiny_base(tmp_path / "base", "klein")
    fx = write_svdq_file(tmp_path / "src", "flux2", "int4")
    # the base's own transformer has the fixture's sizes (publish takes only its text encoder, VAE and scheduler)
    (base / "transformer" / "config.json").write_text(json.dumps(fx.config))
    transformer = tmp_path / "transformer"
    assert run_port(capsys, "convert", fx.path, "--out", transformer, "--strict").code == 0
    manifest = json.loads((transformer / "flux-port.json").read_text())
    assert manifest["dequantized_from"].startswith("Nunchaku SVDQuant int4, rank 16, group 64")
    run = run_port(capsys, "validate", transformer, "--resolution", "128", "--text-len", "32", "--quiet")
    assert run.code == 0, run.err
    run = run_port(capsys, "publish", "--base", base, "--transformer", transformer, "--out", tmp_path / "pub")
    assert run.code == 0, run.err
    card = (tmp_path / "pub" / "README.md").read_text()
    assert "| dequantized from | `Nunchaku SVDQuant int4, rank 16, group 64" in card


@pytest.mark.parametrize("part,value", [("wscales", float("nan")), ("smooth_factor", 0.0), ("wscales", -1.0)])
def test_a_bad_scale_or_smoothing_factor_is_refused_by_name(flux2_file, tmp_path, capsys, part, value):
    key = "transformer_blocks.0.attn.to_out.0." + part
    with safe_open(str(flux2_file.path), "pt") as f:
        t = f.get_tensor(key)
    bad = _rewrite(flux2_file.path, tmp_path / "bad.safetensors", replace={key: torch.full_like(t, value)})
    _refused(capsys, bad, tmp_path / "out", key, "quantization scale", code=1)
