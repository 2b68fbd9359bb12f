"""Recipes end to end (base from ModelScope + fine-tune from the Hub into the workspace), `port recipes`,
and listings that try to write outside the output folder."""

from __future__ import annotations

import json
import os

from tests.hubserver.harness import cli, client_env, hubs, local_files  # noqa: F401  (fixtures)
from tests.hubserver.server import Repo, git_sha1, tiny_pipeline_files


def test_recipe_fetches_base_and_finetune_into_the_workspace(cli, hubs, tmp_path):
    base = hubs.add_ms(Repo("black-forest-labs/FLUX.2-klein-9B", tiny_pipeline_files()))
    ft = hubs.add_hf(Repo("wikeeyang/Flux2-Klein-9B-True-V1", {
        "Flux2-Klein-9B-True-bf16.safetensors": os.urandom(200_000),
        "Flux2-Klein-9B-True-fp8.safetensors": os.urandom(100_000),
        "README.md": b"# True V1\n"}))
    r = cli.run(["fetch", "flux2-klein-9b-true-v1", "--from", "modelscope", "--workspace", "ws", "--json"],
                client_env(tmp_path, hubs), tmp_path)
    assert r.code == 0, r
    folder = tmp_path / "ws" / "flux2-klein-9b-true-v1"
    got_base = local_files(folder / "base")
    got_base.pop("fetch-manifest.json")
    # the diffusers layout without the base's own transformer weights and without BFL's single file
    assert got_base == {p: d for p, d in base.files.items()
                        if p not in ("transformer/diffusion_pytorch_model.safetensors",
                                     "flux-2-klein-tiny.safetensors")}
    got_ft = local_files(folder / "finetune")
    got_ft.pop("fetch-manifest.json")
    assert got_ft == {"Flux2-Klein-9B-True-bf16.safetensors": ft.files["Flux2-Klein-9B-True-bf16.safetensors"]}
    record = json.loads((folder / "port.json").read_text())["fetch"]
    assert record["variant"] == "klein" and record["pipeline"] == "Flux2KleinPipeline"
    assert record["base"]["source"] == "modelscope:black-forest-labs/FLUX.2-klein-9B"
    assert record["finetune"]["source"] == "hf:wikeeyang/Flux2-Klein-9B-True-V1"
    assert record["finetune"]["commit"] == ft.branches["main"]
    assert r.json["recipe"] == "flux2-klein-9b-true-v1" and [p["part"] for p in r.json["parts"]] == ["base",
                                                                                                       "finetune"]
    assert r.json["parts"][1]["source"] == "hf:wikeeyang/Flux2-Klein-9B-True-V1"
    assert r.json["parts"][1]["endpoint"] == hubs.hub_url     # HF_ENDPOINT, not the --from modelscope endpoint
    assert r.json["parts"][0]["out"] == str(folder / "base")


def test_recipe_refuses_per_repository_options(cli, hubs, tmp_path):
    r = cli.run(["fetch", "flux2-klein-4b", "--include", "*.json"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 2, r
    assert "--include cannot be used with a recipe" in r.err and not hubs.log


def test_unknown_recipe_suggests_close_names(cli, hubs, tmp_path):
    r = cli.run(["fetch", "flux2-klein-9b-true"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 2, r
    assert "'flux2-klein-9b-true' is neither a known recipe nor a repository source" in r.err
    assert "Did you mean flux2-klein-9b-true-v1" in r.err


def test_port_recipes_lists_known_ports_as_json(cli, hubs, tmp_path):
    r = cli.run(["recipes", "--json"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 0, r
    recipes = {x["name"]: x for x in r.json["recipes"]}
    assert {"flux2-klein-9b-true-v1", "flux2-klein-4b", "flux2-klein-9b", "flux2-klein-9b-kv"} <= set(recipes)
    true_v1 = recipes["flux2-klein-9b-true-v1"]
    assert true_v1["base"]["repo"] == "black-forest-labs/FLUX.2-klein-9B"
    assert true_v1["finetune"] == {"repo": "wikeeyang/Flux2-Klein-9B-True-V1", "hubs": ["hf"], "revision": None,
                                   "include": [], "exclude": [], "files": ["Flux2-Klein-9B-True-bf16.safetensors"]}
    assert recipes["flux2-klein-9b-kv"]["pipeline"] == "Flux2KleinKVPipeline"
    r = cli.run(["recipes"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 0 and "flux2-klein-9b-true-v1" in r.stdout and "[klein]" in r.stdout


def test_path_traversal_in_a_listing_is_refused_before_writing(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/evil", {"a.json": b"{}"}, extra_listing=[
        {"type": "file", "path": "../escaped.txt", "size": 4, "oid": git_sha1(b"evil")},
        {"type": "file", "path": "/tmp/absolute.txt", "size": 4, "oid": git_sha1(b"evil")}]))
    r = cli.run(["fetch", "hf:acme/evil", "--out", "out", "--include", "a.json"], client_env(tmp_path, hubs),
                tmp_path)
    assert r.code == 1, r
    assert "names 2 path(s) that would be written outside the output folder" in r.err
    assert "'../escaped.txt'" in r.err and "'/tmp/absolute.txt': absolute path" in r.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "escaped.txt").exists()
    assert not hubs.requests(contains="/resolve/")


def test_modelscope_listing_with_traversal_is_refused(cli, hubs, tmp_path):
    hubs.add_ms(Repo("acme/evil", {"a.json": b"{}"}, extra_listing=[
        {"Path": "sub/../../escaped.txt", "Name": "escaped.txt", "Type": "blob", "Size": 4}]))
    r = cli.run(["fetch", "modelscope:acme/evil", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 1, r
    assert "'sub/../../escaped.txt'" in r.err
    assert not (tmp_path / "out").exists() and not hubs.requests(contains="FilePath")


def test_symlink_in_the_output_folder_cannot_redirect_a_write(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/tiny", {"sub/a.json": b"{}"}))
    (tmp_path / "outside").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sub").symlink_to(tmp_path / "outside")
    r = cli.run(["fetch", "hf:acme/tiny", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 1, r
    assert "(symlink in the output folder)" in r.err
    assert not any((tmp_path / "outside").iterdir())
