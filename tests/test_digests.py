"""The identity costs no extra pass: port fetch takes each tensor's sha256 while it verifies a .safetensors file,
and convert reuses them for the tensors it copies byte for byte, as long as the file is the one fetch verified."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from porting import known_digests
from porting.engine.convert import convert
from porting.hub.fetch.paths import MANIFEST_NAME
from porting.hub.fetch.verify import file_digests
from porting.inputs import open_source
from porting.tensors.checkpoint import read_header
from porting.tensors.digests import RangeDigests

from .hubserver.harness import cli, client_env, hubs  # noqa: F401  (fixtures)
from .hubserver.server import Repo


def _tensor_sha256(path: Path) -> dict[tuple[int, int], str]:
    """Each tensor's sha256, read on its own (the reference)."""
    infos, _ = read_header(path)
    data = path.read_bytes()
    return {(i.start, i.nbytes): hashlib.sha256(data[i.start:i.start + i.nbytes]).hexdigest() for i in infos.values()}


def test_range_digests_fed_in_odd_blocks_match_each_range() -> None:
    data = os.urandom(10_000)
    ranges = [(0, 100), (100, 0), (100, 4000), (4100, 17), (5000, 5000)]  # a gap, an empty range, block-sized
    for block in (1, 7, 100, 4096, 10_000):
        digests = RangeDigests(ranges)
        for offset in range(0, len(data), block):
            digests.feed(offset, data[offset:offset + block])
        assert digests.done() == {(a, n): hashlib.sha256(data[a:a + n]).hexdigest() for a, n in ranges}, block


def test_overlapping_ranges_give_no_digests() -> None:
    digests = RangeDigests([(0, 100), (50, 100)])
    digests.feed(0, os.urandom(200))
    assert digests.done() == {}


def test_file_digests_take_each_tensors_sha256_from_the_same_reads(tmp_path: Path, monkeypatch) -> None:
    from porting.hub.fetch import verify

    monkeypatch.setattr(verify, "_BLOCK", 4096)  # tensors span blocks
    rng = np.random.default_rng(0)
    path = tmp_path / "w.safetensors"
    save_file({f"t{i}": rng.standard_normal((random.Random(i).randint(1, 40), 37)).astype(np.float32)
               for i in range(12)}, str(path))
    tensors: dict[tuple[int, int], str] = {}
    sha256, _ = file_digests(path, git=False, tensors=tensors)
    assert sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert tensors == _tensor_sha256(path) and len(tensors) == 12
    other = tmp_path / "config.json"
    other.write_bytes(os.urandom(3000))
    none: dict[tuple[int, int], str] = {}
    file_digests(other, git=False, tensors=none)
    assert none == {}


def _fetched(folder: Path, file: Path, tensors: dict[tuple[int, int], str]) -> None:
    """What port fetch records of `file` once verified: its sha256 and these per-tensor digests, in the one digest
    store (porting.known_digests)."""
    known_digests.remember(file, hashlib.sha256(file.read_bytes()).hexdigest(), tensors=tensors)


def test_convert_reuses_the_digests_fetch_recorded_while_the_file_is_unchanged(tmp_path: Path,
                                                                                tiny2_file: Path) -> None:
    folder = tmp_path / "fetched"
    folder.mkdir()
    src = folder / "klein.safetensors"
    src.write_bytes(tiny2_file.read_bytes())
    truth = convert(src, tmp_path / "plain").weights_sha256
    assert truth == open_source(tmp_path / "plain", kind="weights").weights_sha256

    digests = _tensor_sha256(src)
    _fetched(folder, src, digests)
    assert convert(src, tmp_path / "reused").weights_sha256 == truth

    # a recorded digest is used as it is: one changed in the record changes the identity convert records ...
    wrong = dict(digests)
    first = next(iter(sorted(wrong)))
    wrong[first] = "0" * 64
    _fetched(folder, src, wrong)
    assert convert(src, tmp_path / "trusted").weights_sha256 != truth
    # ... but only while the file is the one fetch verified: touched since, it is hashed again
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert convert(src, tmp_path / "rehashed").weights_sha256 == truth


@pytest.mark.parametrize("bad", ["size", "digest"])
def test_a_record_that_does_not_fit_is_ignored(tmp_path: Path, tiny2_file: Path, bad: str) -> None:
    folder = tmp_path / "fetched"
    folder.mkdir()
    src = folder / "klein.safetensors"
    src.write_bytes(tiny2_file.read_bytes())
    if bad == "size":
        _fetched(folder, src, {k: "f" * 64 for k in _tensor_sha256(src)})
        assert known_digests.known_tensor_digests(src)
        with open(src, "ab") as f:  # the file grew since it was verified
            f.write(b" ")
    else:
        _fetched(folder, src, {k: "not-a-digest" for k in _tensor_sha256(src)})
    assert known_digests.known_tensor_digests(src) == {}


def test_port_fetch_records_each_tensors_sha256(cli, hubs, tmp_path: Path, tiny2_file: Path,  # noqa: F811
                                                monkeypatch) -> None:
    hubs.add_hf(Repo("acme/klein", {"klein.safetensors": tiny2_file.read_bytes(), "config.json": b"{}"}))
    env = client_env(tmp_path, hubs)
    r = cli.run(["fetch", "hf:acme/klein", "--out", "out", "--json"], env, tmp_path)
    assert r.code == 0, r
    doc = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    records = {rec["path"]: rec for rec in doc["files"]}
    expected = {f"{a}:{n}": d for (a, n), d in _tensor_sha256(tmp_path / "out" / "klein.safetensors").items()}
    assert records["klein.safetensors"]["tensors_sha256"] == expected
    assert "tensors_sha256" not in records["config.json"]
    src = tmp_path / "out" / "klein.safetensors"
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(Path(env["HOME"]) / ".local" / "state" / "flux-port"))  # fetch's user
    assert known_digests.known_tensor_digests(src) == _tensor_sha256(src)
