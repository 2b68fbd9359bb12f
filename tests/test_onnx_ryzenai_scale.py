"""The ryzenai export at real size, on the tiny klein: several `--size` values sharing one weights file.

The fast tests pin the option handling (several sizes reach the profile, a repeated size is refused, the graph
names); the slow ones export the tiny klein's transformer and VAE decoder at two sizes and run each graph.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import build_tiny_port  # noqa: E402

from porting.cli.app import main  # noqa: E402
from porting.errors import UsageError  # noqa: E402
from porting.export import ryzenai  # noqa: E402
from porting.export.lint import lint  # noqa: E402
from porting.export.onnx import MANIFEST, export_onnx  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from validation.api import validate  # noqa: E402

SIZES = (32, 48)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


# ---------------------------------------------------------------- fast: options and names

def test_several_sizes_reach_the_profile_in_order(tmp_path, capsys, monkeypatch) -> None:
    """`--size 64 --size 128` used to keep the last size only; now both reach the export, in the order given."""
    import porting.export.onnx as onnx_mod

    seen = {}

    def fake_export(folder, out, **kw):
        seen.update(kw)
        raise UsageError("stopped here")

    monkeypatch.setattr(onnx_mod, "export_onnx", fake_export)
    src = tmp_path / "src"
    src.mkdir()
    code, _, err = run_cli(["export", str(src), "--out", str(tmp_path / "out"), "--target", "ryzenai",
                            "--size", "64", "--size", "128"], capsys)
    assert code == 2 and "stopped here" in err
    assert seen["profile"].sizes == (64, 128) and seen["profile"].size == 64


@pytest.mark.parametrize("sizes, named", [
    ([64, 64], "--size 64 is given twice"),
    ([64, 1000], "--size 1000"),
    ([], "--size"),
])
def test_bad_size_lists_are_refused_by_name(sizes, named) -> None:
    with pytest.raises(UsageError, match=named):
        ryzenai.check_profile(sizes, 8, 16, None)


def test_graph_files_one_per_size_only_when_several() -> None:
    one = ryzenai.check_profile(512, 8, 16, None)
    two = ryzenai.check_profile([512, 768], 8, 16, None)
    assert ryzenai.graph_file("transformer", 512, one) == "model.onnx"  # the one-size layout is unchanged
    assert ryzenai.graph_file("transformer", 768, two) == "model_768.onnx"
    assert ryzenai.graph_file("vae_decoder", 512, two) == "model_512.onnx"
    assert ryzenai.graph_file("text_encoder", 512, two) == ryzenai.TEXT_ENCODER_FILE  # no image size in its shapes


# ---------------------------------------------------------------- slow: two sizes of the tiny klein

@pytest.fixture(scope="module")
def sized_export(tmp_path_factory) -> tuple[Path, Path, dict]:
    port = build_tiny_port(tmp_path_factory.getbasetemp() / "tiny-port")
    folder = tmp_path_factory.mktemp("rzs-src") / "klein"
    publish(port["base"], port["transformer"], folder, report=port["pass"])
    out = tmp_path_factory.mktemp("rzs") / "klein-ryzenai"
    profile = ryzenai.check_profile(list(SIZES), 8, 16, None)
    export_onnx(folder, out, target="ryzenai", profile=profile, components=["transformer", "vae_decoder"])
    return folder, out, json.loads((out / MANIFEST).read_text())


def _external(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (location, offset, length) of every external initializer of a graph."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in t.external_data}
            out[t.name] = (where["location"], int(where.get("offset", 0)), int(where["length"]))
    return out


@pytest.mark.slow
def test_two_sizes_share_one_weights_file_written_once(sized_export) -> None:
    _, out, manifest = sized_export
    for c in ("transformer", "vae_decoder"):
        files = sorted(p.name for p in (out / c).iterdir())
        assert files == ["config.json", "model.onnx.data", "model_32.onnx", "model_48.onnx"], files
        a, b = _external(out / c / "model_32.onnx"), _external(out / c / "model_48.onnx")
        weights = [n for n in a if n.startswith(("model.", "vae."))]
        assert weights and len(weights) == len([n for n in b if n.startswith(("model.", "vae."))])
        # by name and by bytes: each weight of the second graph is the first graph's, same file, offset and length
        assert {n: a[n] for n in weights} == {n: b[n] for n in weights}
        assert {loc for loc, _, _ in list(a.values()) + list(b.values())} == {"model.onnx.data"}
        # written once: the file holds one copy of the weights (plus the few folded constants of each size)
        weight_bytes = sum(length for _, _, length in (a[n] for n in weights))
        assert (out / c / "model.onnx.data").stat().st_size < 1.5 * weight_bytes
        graphs = manifest["components"][c]["graphs"]
        assert set(graphs) == {"32", "48"} and manifest["components"][c]["data_file"] == "model.onnx.data"
    assert manifest["profile"]["sizes"] == list(SIZES) and manifest["profile"]["size"] == SIZES[0]
    shapes = manifest["components"]["transformer"]["graphs"]
    assert shapes["32"]["input_shapes"]["hidden_states"] == [1, 4, 16]
    assert shapes["48"]["input_shapes"]["hidden_states"] == [1, 9, 16]
    assert manifest["components"]["vae_decoder"]["graphs"]["48"]["input_shapes"]["latent_sample"][2:] == [6, 6]


@pytest.mark.slow
def test_check_reads_every_graph_and_passes(sized_export, capsys) -> None:
    _, out, manifest = sized_export
    result = lint(out, "ryzenai")
    assert result.ok and {"transformer/model_32.onnx", "transformer/model_48.onnx", "vae_decoder/model_32.onnx",
                          "vae_decoder/model_48.onnx"} <= set(result.files)
    assert manifest["check"]["ok"] is True and len(manifest["check"]["files"]) == 4
    code, stdout, _ = run_cli(["export", "--check", str(out), "--target", "ryzenai", "--json"], capsys)
    assert code == 0 and len(json.loads(stdout)["files"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_each_size_runs_on_onnxruntime_and_matches_torch(sized_export, tmp_path, size) -> None:
    _, out, _ = sized_export
    d = validate(out / "transformer", runtime="onnxruntime", resolution=size, out=tmp_path / "rep").to_dict()
    assert d["verdict"] == "pass", d["reasons"]
    assert d["inputs"]["resolution"] == size and d["output"]["ratio"] <= 2
    assert Path(d["environment"]["device"]["model"]).name == f"model_{size}.onnx"


@pytest.mark.slow
def test_a_folder_of_several_graphs_without_a_size_is_refused_by_name(sized_export) -> None:
    from porting.errors import InputError
    from porting.export.ort import open_session

    _, out, _ = sized_export
    with pytest.raises(InputError, match="model_32.onnx, model_48.onnx"):
        open_session(out / "transformer")
