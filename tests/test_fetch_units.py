"""Pure pieces of `port fetch`: glob dialect, sources and endpoints, unsafe paths, workspace, recipes, disk check,
manifest records, and the client-error tables."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from porting.errors import AuthError, CheckFailed, DiskSpaceError, InputError, MappingTableError, NetworkError
from porting.hub.fetch import manifest
from porting.hub.fetch.globs import matches, select
from porting.hub.fetch.paths import check_listing, unsafe_reason
from porting.hub.fetch.plan import Listing, Plan, PlannedFile, check_disk_space, choose
from porting.hub.fetch.sources import Source, normalize_endpoint, parse_source
from porting.hub.fetch.verify import RemoteFile, mismatch
from porting.hub.recipes import load_recipes, parse_recipes
from porting.hub.workspace import ENV_HOME, recipe_paths, record_step, workspace_root

# -- glob dialect ------------------------------------------------------------------------------------------------
GLOB_CASES = [
    # a pattern without '/' matches a file name in any folder
    ("*.json", "model_index.json", True),
    ("*.json", "vae/config.json", True),
    # a pattern with '/' is anchored at the root, and '*' does not cross '/'
    ("vae/*.json", "vae/config.json", True),
    ("vae/*.json", "x/vae/config.json", False),
    ("*/config.json", "a/b/config.json", False),
    # '**' crosses folders, '**/' may match no folder at all
    ("text_encoder/**", "text_encoder/a/b.safetensors", True),
    ("**/config.json", "config.json", True),
    ("**/config.json", "a/b/config.json", True),
    # a trailing '/' selects the whole folder, not a same-prefix sibling
    ("tokenizer/", "tokenizer/tokenizer.json", True),
    ("tokenizer/", "tokenizer_2/tokenizer.json", False),
    # '?' and classes, case-sensitive
    ("model-0000?.safetensors", "model-00001.safetensors", True),
    ("[!m]*.json", "model_index.json", False),
    ("*.JSON", "a.json", False),
    # a leading '/' anchors a plain name at the root
    ("/README.md", "README.md", True),
    ("/README.md", "docs/README.md", False),
    # regex metacharacters are literal
    ("a+b(1).json", "a+b(1).json", True),
]


@pytest.mark.parametrize("pattern,path,expected", GLOB_CASES, ids=[f"{c[0]}|{c[1]}" for c in GLOB_CASES])
def test_glob_dialect(pattern, path, expected):
    assert matches(path, pattern) is expected


def test_select_applies_includes_then_excludes_in_listing_order():
    paths = ["b.json", "a.safetensors", "vae/c.json", "scheduler/s.json"]
    assert select(paths, ["*.json"], ["scheduler/"]) == ["b.json", "vae/c.json"]
    assert select(paths) == paths


def test_bad_glob_is_an_input_error():
    with pytest.raises(InputError):
        matches("a", "[abc")


# -- sources and endpoints ---------------------------------------------------------------------------------------
def test_parse_sources(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("MODELSCOPE_ENDPOINT", raising=False)
    assert parse_source("hf:black-forest-labs/FLUX.2-klein-4B") == Source(
        "hf", "black-forest-labs/FLUX.2-klein-4B", "https://huggingface.co")
    assert parse_source("ms:org/name") == Source("modelscope", "org/name", "https://modelscope.cn")
    assert parse_source("org/name", via="mirror").endpoint == "https://hf-mirror.com"
    assert parse_source("org/name", via="modelscope").hub == "modelscope"
    assert parse_source("hf:org/name", endpoint="hf-mirror").endpoint == "https://hf-mirror.com"
    assert parse_source("flux2-klein-4b") is None                   # a recipe name
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    assert parse_source("hf:org/name").endpoint == "http://127.0.0.1:9"


@pytest.mark.parametrize("text,via", [("hf:org/name", "modelscope"), ("gh:org/name", None), ("hf:org", None),
                                      ("hf:../x", None), ("hf:org/na me", None)])
def test_bad_sources_are_input_errors(text, via):
    with pytest.raises(InputError):
        parse_source(text, via=via)


@pytest.mark.parametrize("value", ["hf-mirror.com", "ftp://x.org", "https://user:pw@hf-mirror.com",
                                   "https://x.org/?token=1"])
def test_bad_endpoints(value):
    with pytest.raises(InputError):
        normalize_endpoint(value)


def test_only_the_hubs_own_https_hosts_get_tokens():
    assert Source("hf", "a/b", "https://huggingface.co").official
    assert not Source("hf", "a/b", "https://hf-mirror.com").official
    assert not Source("hf", "a/b", "http://huggingface.co").official
    assert Source("modelscope", "a/b", "https://www.modelscope.cn").official
    assert not Source("modelscope", "a/b", "https://huggingface.co").official


# -- unsafe paths ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "C:/x", "a\\..\\x", "a//b", "./a", "",
                                  "a/\x1b[31mred", "fetch-manifest.json", ".fetch-partial/x.part"])
def test_unsafe_repository_paths(path):
    assert unsafe_reason(path) is not None


def test_plain_paths_are_safe():
    assert unsafe_reason("text_encoder/model-00001-of-00002.safetensors") is None
    assert unsafe_reason("..hidden/x") is None                   # '..' only as a whole segment is traversal


def test_listing_with_file_and_folder_clash_is_refused(tmp_path):
    with pytest.raises(CheckFailed) as err:
        check_listing(["a", "a/b"], tmp_path, "org/name")
    assert "'a': listed both as a file and as a folder" in err.value.details


def test_symlink_escape_is_refused_but_an_inner_link_is_fine(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "inner").mkdir()
    (tmp_path / "out" / "link_in").symlink_to(tmp_path / "out" / "inner")
    check_listing(["link_in/x.json"], tmp_path / "out", "org/name")
    (tmp_path / "out" / "link_out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckFailed) as err:
        check_listing(["link_out/x.json"], tmp_path / "out", "org/name")
    assert "outside" in err.value.details


# -- workspace ---------------------------------------------------------------------------------------------------
def test_workspace_root_and_recipe_paths(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_HOME, raising=False)
    assert workspace_root() == Path("ports")
    monkeypatch.setenv(ENV_HOME, str(tmp_path / "home"))
    assert workspace_root() == tmp_path / "home"
    assert workspace_root(tmp_path / "w") == tmp_path / "w"          # --workspace wins
    p = recipe_paths("flux2-klein-4b")
    assert p.base == tmp_path / "home" / "flux2-klein-4b" / "base"
    assert (p.finetune.name, p.transformer.name, p.reports.name, p.published.name, p.port_json.name) == (
        "finetune", "transformer", "reports", "published", "port.json")
    with pytest.raises(InputError):
        recipe_paths("../evil")


def test_record_step_keeps_other_verbs(tmp_path):
    p = recipe_paths("r1", tmp_path)
    record_step(p, "fetch", {"a": 1})
    record_step(p, "convert", {"b": 2})
    record_step(p, "fetch", {"a": 3})
    import json

    assert json.loads(p.port_json.read_text()) == {"format_version": 1, "recipe": "r1", "fetch": {"a": 3},
                                                 "convert": {"b": 2}}


# -- recipes -----------------------------------------------------------------------------------------------------
def test_shipped_recipes_are_valid_and_fit_their_pipeline():
    recipes = load_recipes()
    assert set(recipes) == {"flux2-klein-9b-true-v1", "flux2-klein-4b", "flux2-klein-9b", "flux2-klein-9b-kv"}
    r = recipes["flux2-klein-9b-true-v1"]
    assert (r.base.repo, r.finetune.repo, r.finetune.files) == (
        "black-forest-labs/FLUX.2-klein-9B", "wikeeyang/Flux2-Klein-9B-True-V1",
        ("Flux2-Klein-9B-True-bf16.safetensors",))
    assert "modelscope" in r.base.hubs and r.pipeline == "Flux2KleinPipeline"
    assert recipes["flux2-klein-9b-kv"].pipeline == "Flux2KleinKVPipeline"
    # the base keeps the transformer config but not the transformer weights or BFL's single file
    base_files = ["model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
                  "flux-2-klein-9b.safetensors", "text_encoder/model-00001-of-00002.safetensors", "vae/config.json"]
    assert select(base_files, r.base.include, r.base.exclude) == [
        "model_index.json", "transformer/config.json", "text_encoder/model-00001-of-00002.safetensors",
        "vae/config.json"]


@pytest.mark.parametrize("doc,message", [
    ({"format_version": 2, "recipes": {}}, "format_version"),
    ({"format_version": 1, "recipes": {"x": {"variant": "dev", "base": {"repo": "a/b"}}}}, "variant"),
    ({"format_version": 1, "recipes": {"x": {"variant": "klein", "pipeline": "Flux2KleinKVPipeline",
                                             "base": {"repo": "a/b"}}}}, "uses Flux2KleinPipeline"),
    ({"format_version": 1, "recipes": {"x": {"variant": "klein", "base": {"repo": "a/b", "hubs": ["gh"]}}}},
     "hubs"),
    ({"format_version": 1, "recipes": {"x": {"variant": "klein", "base": {"repo": "a/b", "revison": "v1"}}}},
     "unknown field"),
    ({"format_version": 1, "recipes": {"x": {"variant": "klein", "base": {"repo": "a/b", "files": ["f"],
                                                                          "include": ["*"]}}}}, "either files"),
])
def test_malformed_recipes_are_rejected(doc, message):
    with pytest.raises(MappingTableError, match=message):
        parse_recipes(doc)


# -- plan, disk check, verification, manifest --------------------------------------------------------------------
def _plan(tmp_path: Path, sizes: dict[str, int], states: dict[str, tuple[str, int]] | None = None) -> Plan:
    files = [PlannedFile(RemoteFile(p, s), *(states or {}).get(p, ("missing", 0))) for p, s in sizes.items()]
    listing = Listing("main", "c" * 40, [f.remote for f in files])
    return Plan("source", Source("hf", "a/b", "https://huggingface.co"), tmp_path / "out", listing, {}, files)


def test_disk_check_counts_only_what_is_still_missing(tmp_path):
    plan = _plan(tmp_path, {"a": 100, "b": 50, "c": 30}, {"a": ("verified", 0), "b": ("partial", 20)})
    assert plan.missing_bytes == 30 + 30
    check_disk_space([plan], free=lambda p: 60)
    with pytest.raises(DiskSpaceError, match=r"\(60 bytes\) still to download, 59 B \(59 bytes\) free"):
        check_disk_space([plan], free=lambda p: 59)


def test_disk_check_adds_up_plans_on_the_same_volume(tmp_path):
    plans = [_plan(tmp_path, {"a": 40}), _plan(tmp_path, {"b": 40})]
    with pytest.raises(DiskSpaceError, match=r"\(80 bytes\) still to download"):
        check_disk_space(plans, free=lambda p: 79)


def test_choose_file_and_patterns():
    listing = Listing("main", None, [RemoteFile("a.json", 1), RemoteFile("w.safetensors", 2)])
    assert [f.path for f in choose(listing, "a/b", [], [], ["w.safetensors"])] == ["w.safetensors"]
    assert [f.path for f in choose(listing, "a/b", ["*.json"], [], [])] == ["a.json"]
    with pytest.raises(InputError, match="No file of a/b at main matches"):
        choose(listing, "a/b", ["*.bin"], [], [])


def test_mismatch_checks_sha256_git_sha1_and_size(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"hello")
    sha = hashlib.sha256(b"hello").hexdigest()
    git = hashlib.sha1(b"blob 5\0hello").hexdigest()
    assert mismatch(f, RemoteFile("f", 5, sha256=sha)) == (None, sha)
    assert mismatch(f, RemoteFile("f", 5, git_sha1=git)) == (None, sha)
    assert mismatch(f, RemoteFile("f", 5))[0] is None                  # size only
    assert "expected 6" in mismatch(f, RemoteFile("f", 6))[0]
    assert "sha256" in mismatch(f, RemoteFile("f", 5, sha256="0" * 64))[0]
    assert "git blob sha1" in mismatch(f, RemoteFile("f", 5, git_sha1="0" * 40))[0]


def test_manifest_record_is_trusted_only_for_the_same_file_and_content(tmp_path):
    f = tmp_path / "w"
    f.write_bytes(b"abc")
    remote = RemoteFile("w", 3, sha256="1" * 64)
    rec = manifest.file_record(remote, f, "1" * 64)
    assert manifest.still_verified(rec, remote, f)
    assert not manifest.still_verified(rec, RemoteFile("w", 3, sha256="2" * 64), f)   # new content upstream
    os.utime(f, ns=(rec["mtime_ns"] + 10**9, rec["mtime_ns"] + 10**9))
    assert not manifest.still_verified(rec, remote, f)                               # touched locally


# -- client error tables -----------------------------------------------------------------------------------------
def _hf(endpoint: str = "https://hf-mirror.com", withheld: bool = True):
    from porting.hub.fetch.hf_backend import HfBackend

    backend = HfBackend.__new__(HfBackend)  # the table only needs these fields; no client set-up
    backend.source, backend.timeout, backend.token_withheld = Source("hf", "a/b", endpoint), 5.0, withheld
    return backend


def test_hf_error_table():
    import httpx2
    from huggingface_hub import errors as hf

    def http_error(cls, status):
        request = httpx2.Request("GET", "https://hf-mirror.com/api/models/a/b")
        return cls("boom", response=httpx2.Response(status, request=request))

    gated = _hf().translate(http_error(hf.GatedRepoError, 401), "main")
    assert isinstance(gated, AuthError) and gated.exit_code == 3
    assert "accept the licence" in gated.hint.lower() and "--send-token" in gated.hint
    assert "authorized list" in _hf().translate(http_error(hf.GatedRepoError, 403), "main").message
    assert isinstance(_hf().translate(http_error(hf.RepositoryNotFoundError, 404), "main"), InputError)
    assert isinstance(_hf().translate(http_error(hf.HfHubHTTPError, 503), "main"), NetworkError)
    assert isinstance(_hf().translate(httpx2.ReadTimeout("slow"), "main"), NetworkError)
    full = _hf().translate(OSError(errno.ENOSPC, "No space left on device"), "main", path="w.safetensors")
    assert isinstance(full, DiskSpaceError) and full.exit_code == 5


def test_ms_error_table():
    from modelscope_hub import errors as ms

    from porting.hub.fetch.ms_backend import MsBackend

    backend = MsBackend.__new__(MsBackend)
    backend.source, backend.timeout, backend.token_withheld = Source("modelscope", "a/b",
                                                                     "https://modelscope.cn"), 5.0, False
    import requests

    wrapped = requests.HTTPError("401")
    wrapped.__cause__ = ms.AuthenticationError("no token", status_code=401)
    assert isinstance(backend.translate(wrapped, "master"), AuthError)
    assert isinstance(backend.translate(ms.PermissionDeniedError("no", status_code=403), "master"), AuthError)
    assert isinstance(backend.translate(ms.NotExistError("gone", status_code=404), "master"), InputError)
    assert isinstance(backend.translate(ms.RequestTimeoutError("slow"), "master"), NetworkError)
    assert isinstance(backend.translate(ms.FileIntegrityError("bad"), "master", path="w"), CheckFailed)
    assert isinstance(backend.translate(OSError(errno.ENOSPC, "full"), "master", path="w"), DiskSpaceError)


def test_local_disk_errors_map_to_exit_codes():
    from porting.hub.fetch.engine import _local_error

    full = _local_error(OSError(errno.ENOSPC, "No space left on device", "/data/x.part"))
    assert isinstance(full, DiskSpaceError) and "/data/x.part" in full.message
    denied = _local_error(PermissionError(errno.EACCES, "Permission denied", "/data/x"))
    assert denied.exit_code == 2 and "Permission denied" in denied.message
