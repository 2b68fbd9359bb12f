"""A 4-bit text encoder in a real pipeline: klein-wide's own Qwen3 written 4-bit by flux-port, run packed in
Flux2KleinPipeline in place of the bf16 one; the prompt embeddings' error against bf16 measured, the image made."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from porting.engine.awq_quantize import quantize_text_encoder
from porting.errors import InputError
from porting.pipeline import pipeload
from porting.pipeline.text_encoder_swap import embedding_error, open_swap, own_encoder
from porting.runtime.awq_text import AwqLinear


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, Path]:
    from porting.demo.bases import write_tiny_base

    root = tmp_path_factory.mktemp("wide")
    base = write_tiny_base(root / "base", "klein-wide")
    result = quantize_text_encoder(base / "text_encoder", root / "te4")
    return base, root / "te4" / result.file


def test_the_packed_encoder_runs_in_the_pipeline_with_a_small_embedding_error(wide):
    base, file = wide
    source = open_swap(base, file)
    pipe = pipeload.load(base, torch.device("cpu"), torch.bfloat16, text_encoder_file=source)
    packed = pipe.text_encoder
    assert sum(isinstance(m, AwqLinear) for m in packed.modules()) == 27 * 7
    own = own_encoder(base, "text_encoder", torch.bfloat16)
    error = embedding_error(pipe, "text_encoder", own, ["a red fox in the snow"])
    assert 0 < error < 0.5  # 4-bit weights move the features; the same weights would give 0
    assert pipe.text_encoder is packed
    reference = pipeload.load(base, torch.device("cpu"), torch.bfloat16)
    assert embedding_error(reference, "text_encoder", own, ["a red fox"]) == 0.0
    image = pipe(prompt="a red fox in the snow", num_inference_steps=1, height=32, width=32, max_sequence_length=32,
                 generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and bool(torch.isfinite(image).all())


def test_a_text_encoder_that_does_not_fit_the_pipeline_is_refused_before_loading(wide, tmp_path):
    from porting.demo.bases import write_tiny_base

    _, file = wide
    narrow = write_tiny_base(tmp_path / "klein", "klein")  # hidden 16: the file's 128-wide features do not fit
    with pytest.raises(InputError) as err:
        open_swap(narrow, file)
    assert "hidden_size is 128, the pipeline's text_encoder has 16" in str(err.value)
    with pytest.raises(InputError) as err:
        open_swap(narrow, narrow / "text_encoder")
    assert "a bf16 text encoder" in str(err.value) and "--quantize awq-int4" in err.value.hint


def test_generate_and_compare_take_the_4_bit_text_encoder(wide, tmp_path, capsys):
    import json

    from .helpers import run_port

    base, file = wide
    run = run_port(capsys, "generate", base, "--prompt", "a red fox", "--text-encoder", file, "--steps", "1",
                   "--size", "32", "--output", tmp_path / "fox.png", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["text_encoder"]["slot"] == "text_encoder" and 0 < doc["text_encoder"]["embedding_rel_l2"] < 0.5
    assert (tmp_path / "fox.png").is_file()
    run = run_port(capsys, "compare", base, base, "--candidate-text-encoder", file, "--steps", "1", "--size", "32",
                   "--prompt", "a red fox", "--out", tmp_path / "cmp", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["candidate"]["text_encoder"] == str(file.resolve())
    assert doc["candidate"]["embedding_rel_l2"] == pytest.approx(
        json.loads((tmp_path / "cmp" / "compare.json").read_text())["candidate"]["embedding_rel_l2"])
    assert 0 < doc["candidate"]["embedding_rel_l2"] < 0.5 and doc["settings"]["text_encoder"].startswith("each side")
    assert doc["summary"]["psnr"]["mean"] < 99  # its own embeddings: the images differ from the reference's


@pytest.mark.slow  # four pipelines loaded and run in turn
def test_bench_card_rows_the_base_against_its_4_bit_files(wide, tmp_path, capsys):
    import json

    from porting.engine.svdq_convert import convert_svdquant

    from .helpers import run_port

    base, file = wide
    svdq = convert_svdquant(base / "transformer", tmp_path / "svdq", "svdq-int4", rank=16)
    run = run_port(capsys, "bench", base, "--transformer", svdq.out / svdq.files[0], "--text-encoder", file,
                   "--card", "--offload", "none", "--task", "t2i", "--runs", "1", "--warmup", "0", "--size", "32",
                   "--steps", "1", "--out", tmp_path / "b", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert [r["model"] for r in doc["rows"]] == ["base", "4-bit text encoder", "4-bit transformer",
                                                 "4-bit transformer + text encoder"]
    assert all(r["status"] == "ok" and r["s_per_image"] > 0 for r in doc["rows"])
    assert doc["text_encoder"]["file"] == str(file.resolve()) and doc["svdq"]["format"].startswith("SVDQuant")
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "| model | task | offload |" in md and "| 4-bit transformer + text encoder | t2i | none |" in md


def test_bench_card_needs_a_4_bit_file_and_refuses_before_loading(wide, tmp_path, capsys):
    from .helpers import run_port

    base, _ = wide
    run = run_port(capsys, "bench", base, "--card", "--out", tmp_path / "c")
    assert run.code == 2 and "--card compares the base with its 4-bit files" in run.msg
    assert not (tmp_path / "c").exists()


def test_validate_encodes_the_prompt_with_the_4_bit_text_encoder(wide, tmp_path, capsys):
    import json

    from .helpers import run_port

    base, file = wide
    run = run_port(capsys, "validate", base / "transformer", "--base", base, "--prompt", "a red fox",
                   "--text-encoder", file, "--resolution", "32", "--text-len", "16", "--timesteps", "1.0",
                   "--out", tmp_path / "v", "--json")
    assert run.code in (0, 1), run.err  # the verdict is the transformer's; the features are what is checked here
    inputs = json.loads(run.out)["inputs"]
    assert inputs["text_encoder_4bit"] and 0 < inputs["prompt_features_error"] < 0.5
    run = run_port(capsys, "validate", base / "transformer", "--text-encoder", file, "--out", tmp_path / "w")
    assert run.code == 2 and "--text-encoder encodes --prompt" in run.msg and not (tmp_path / "w").exists()


def test_the_converted_bf16_folder_loads_as_the_pipelines_text_encoder(wide, tmp_path):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Model

    from porting.engine.text_encoder import convert_text_encoder

    base, file = wide
    convert_text_encoder(file, tmp_path / "te-bf16")
    encoder = Qwen3Model.from_pretrained(tmp_path / "te-bf16", dtype=torch.bfloat16)
    pipe = Flux2KleinPipeline.from_pretrained(base, text_encoder=encoder, dtype=torch.bfloat16)
    packed = pipeload.load(base, torch.device("cpu"), torch.bfloat16, text_encoder_file=open_swap(base, file))
    with torch.no_grad():
        want = pipe.encode_prompt(prompt="a red fox", device="cpu", max_sequence_length=32)[0]
        got = packed.encode_prompt(prompt="a red fox", device="cpu", max_sequence_length=32)[0]
    assert torch.equal(got, want)  # the packed encoder computes what the converted folder computes
