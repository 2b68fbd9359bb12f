"""What flux-port knows of a file is kept, sealed, by inode, and is a hint: convert records the weights identity of
the shards it writes and each tensor's digest (taken from fetch's records, or hashed from the source), never the
file's own sha256, which the first verb that certifies the file takes (publish, push) and records for the others.
A record describes the file by device, inode, size, modification time and change time: an edit in place that puts
size and modification time back is still seen.

Oracles: hashlib over the file's bytes on disk, the weights identity recomputed tensor by tensor
(`hash_checkpoint`), and the bytes a process actually read (`rchar` of /proc/self/io).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tinyport import write_report  # noqa: E402

from porting.demo.lora import write_tiny_lora  # noqa: E402
from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint  # noqa: E402
from porting.demo.tinypipe import build_demo_base  # noqa: E402
from porting.engine.convert import convert  # noqa: E402
from porting.errors import CheckFailed  # noqa: E402
from porting.hub.push.identity import local_identity  # noqa: E402
from porting.inputs import open_source  # noqa: E402
from porting.known_digests import file_sha256, known_sha256, known_weights  # noqa: E402
from porting.pipeline.publish import publish  # noqa: E402
from porting.tensors.identity import hash_checkpoint  # noqa: E402
from tests.helpers import run_cli  # noqa: E402


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A sealing key and state folder of this test's own."""
    folder = tmp_path / "state"
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def finetune(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ft") / "tiny-klein-ft.safetensors", TINY_FLUX2, seed=1)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def bytes_read() -> int:
    """Bytes this process has read through read(2) and its kind (page cache hits included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def convert_case(case: str, src: Path, out: Path, capsys: pytest.CaptureFixture) -> None:
    if case == "copy, shards":  # renames and qkv splits: bytes copied by the kernel, never through the process
        convert(src, out, max_shard_size="80KB")
    elif case == "fp16":  # every tensor computed in memory
        convert(src, out, dtype="fp16")
    elif case == "to original":  # concatenations back into fused tensors
        convert(src, out.parent / "diffusers")
        convert(out.parent / "diffusers", out, to="original")
    else:  # a LoRA merged: rows filled by the merge
        convert(src, out.parent / "base")
        lora = write_tiny_lora(out.parent / "lora.safetensors", out.parent / "base")
        code, _, err = run_cli(["merge", str(out.parent / "base"), str(lora), "--out", str(out)], capsys)
        assert code == 0, err


CASES = ["copy, shards", "fp16", "to original", "merge"]


def tensor_ranges(f: Path) -> dict[tuple[int, int], str]:
    """Oracle: each tensor's byte range in the file (from its header, read here) and the sha256 of those bytes."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {(8 + n + a, b - a): hashlib.sha256(raw[8 + n + a:8 + n + b]).hexdigest()
            for k, v in header.items() if k != "__metadata__" for a, b in [v["data_offsets"]]}


@pytest.mark.parametrize("case", CASES)
def test_every_written_shard_records_its_weights_and_tensors_not_its_file_digest(
        case: str, finetune: Path, tmp_path: Path, state: Path, capsys: pytest.CaptureFixture) -> None:
    from porting.known_digests import known_tensor_digests

    out = tmp_path / "out"
    convert_case(case, finetune, out, capsys)
    files = shards(out)
    assert len(files) >= (3 if case.endswith("shards") else 1)
    assert known_weights(files) == hash_checkpoint(open_source(out).view)
    manifest = json.loads((out / "flux-port.json").read_text())
    assert known_weights(files) == manifest["weights_sha256"] and "files_sha256" not in manifest
    for f in files:
        assert known_sha256(f) is None, f  # left to the first verb that certifies the file
        assert known_tensor_digests(f) == tensor_ranges(f)
        assert file_sha256(f) == sha256(f) and known_sha256(f) == sha256(f)  # taken once, then kept
    assert known_weights(files) == manifest["weights_sha256"]  # beside the weights identity, not instead of it


def test_identity_of_unchanged_shards_reads_no_tensor_and_each_file_is_hashed_once(finetune: Path, tmp_path: Path,
                                                                                   state: Path) -> None:
    out = tmp_path / "out"
    convert(finetune, out, max_shard_size="80KB")
    size = sum(f.stat().st_size for f in shards(out))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in shards(out))
    before = bytes_read()
    weights = open_source(out).weights_sha256
    read = bytes_read() - before
    assert read - headers < 32 * 1024, f"read {read} bytes, {headers} of them headers"  # and the sealed records
    before = bytes_read()
    digests = [file_sha256(f) for f in shards(out)]  # the first certifying verb reads each byte once
    assert size <= bytes_read() - before < size + 64 * 1024
    before = bytes_read()
    again = [file_sha256(f) for f in shards(out)]
    assert bytes_read() - before < 32 * 1024  # and records it for the others
    assert again == digests == [sha256(f) for f in shards(out)]
    assert weights == hash_checkpoint(open_source(out).view)

    fresh = tmp_path / "other-state"  # the control: without the records, the same calls read every byte
    os.environ["FLUX_PORT_STATE_DIR"] = str(fresh)
    before = bytes_read()
    assert open_source(out).weights_sha256 == weights
    assert bytes_read() - before > size * 0.9


def test_convert_after_fetch_reads_each_byte_once(finetune: Path, tmp_path: Path, state: Path) -> None:
    """Warm convert: with the per-tensor digests port fetch records, convert reads each source byte once, the kernel's
    copy (`copy_file_range` counts in rchar), and hashes only the tensors it splits; it reads nothing of what it
    wrote back (no file sha256 is taken), which cost one more pass over the output before."""
    from porting.known_digests import known_tensor_digests, remember

    src = tmp_path / "fetched.safetensors"
    src.write_bytes(finetune.read_bytes())
    remember(src, sha256(src), tensors=tensor_ranges(src))  # what port fetch records when it verifies a download
    convert(src, tmp_path / "warm-up")  # the lazy imports of a first convert read files too
    size = src.stat().st_size
    before = bytes_read()
    result = convert(src, tmp_path / "out")
    read = bytes_read() - before
    assert size <= read < size * 1.5, f"convert read {read} bytes of a {size}-byte checkpoint"
    out = shards(tmp_path / "out")
    assert result.weights_sha256 == hash_checkpoint(open_source(tmp_path / "out").view) == known_weights(out)
    assert known_tensor_digests(out[0]) == tensor_ranges(out[0])


def test_an_edit_in_place_that_puts_size_and_mtime_back_is_seen(finetune: Path, tmp_path: Path,
                                                                state: Path) -> None:
    """The change time is the kernel's: `touch -d` cannot set it back, so the records no longer describe the file."""
    out = tmp_path / "out"
    convert(finetune, out)
    f = shards(out)[0]
    file_sha256(f)
    edit_in_place_keeping_size_and_mtime(f)
    assert known_sha256(f) is None and known_weights([f]) is None
    assert file_sha256(f) == sha256(f)


def edit_in_place_keeping_size_and_mtime(victim: Path) -> None:
    """The last byte of the last tensor flipped in place (the same inode: a hard link shares the edit), then the
    modification time put back to the nanosecond."""
    st = victim.stat()
    with open(victim, "r+b") as fh:
        fh.seek(st.st_size - 1)
        last = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([last[0] ^ 0x01]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (victim.stat().st_size, victim.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_changed_shard_is_hashed_again_and_publish_refuses_it(finetune: Path, tmp_path: Path, state: Path) -> None:
    out = tmp_path / "out"
    result = convert(finetune, out, max_shard_size="80KB")
    victim = shards(out)[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: same size, other weights
    victim.write_bytes(data)
    assert known_sha256(victim) is None and known_weights(shards(out)) is None
    assert open_source(out).weights_sha256 != result.weights_sha256
    base = build_demo_base(tmp_path / "base")
    report = write_report(tmp_path / "reports", result.weights_sha256)
    with pytest.raises(CheckFailed, match="weights changed since port convert wrote them"):
        publish(base, out, tmp_path / "pub", report=report)


def test_a_touched_shard_is_not_trusted(finetune: Path, tmp_path: Path, state: Path) -> None:
    out = tmp_path / "out"
    convert(finetune, out)
    f = shards(out)[0]
    file_sha256(f)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert known_sha256(f) is None and known_weights([f]) is None
    assert file_sha256(f) == sha256(f) and known_sha256(f) == sha256(f)  # hashed again, and kept


def test_records_sealed_under_another_key_prove_nothing(finetune: Path, tmp_path: Path, state: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    convert(finetune, out)
    f = shards(out)[0]
    assert file_sha256(f) == sha256(f) and known_sha256(f) == sha256(f) and known_weights([f]) is not None
    other = tmp_path / "other-state"
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(other))
    assert known_sha256(f) is None  # a new key
    (other / "digests").mkdir(parents=True)
    for record in (state / "digests").iterdir():  # the same records copied in: their seal does not verify
        (other / "digests" / record.name).write_bytes(record.read_bytes())
    assert known_sha256(f) is None and known_weights([f]) is None


def test_records_of_another_set_do_not_name_these_weights(finetune: Path, tmp_path: Path, state: Path) -> None:
    """Shards written together are trusted only together: one shard with a foreign file, or missing, is not."""
    out = tmp_path / "out"
    convert(finetune, out, max_shard_size="80KB")
    files = shards(out)
    assert known_weights(files) is not None
    assert known_weights(files[:2]) is None  # a shard missing
    other = tmp_path / "other"
    convert(finetune, other)
    assert known_weights(files + shards(other)) is None  # two folders


def test_publish_hashes_the_transformer_once_and_refuses_an_edit_in_place(finetune: Path, tmp_path: Path,
                                                                          state: Path) -> None:
    """Publish after convert takes each transformer file's sha256 (once: a second publish reads none of it) and its
    hard links keep the records. A same-size edit in place that puts the modification time back (`touch -d`) is
    refused at the gate, as the weights changed since convert and validate: the records no longer describe it."""
    out = tmp_path / "transformer"
    result = convert(finetune, out, max_shard_size="80KB")
    base = build_demo_base(tmp_path / "base")
    report = write_report(tmp_path / "reports", result.weights_sha256)
    pub = publish(base, out, tmp_path / "pub", report=report)
    manifest = json.loads((tmp_path / "pub" / "manifest.json").read_text())
    for f in shards(out):
        assert manifest["files"][f"transformer/{f.name}"]["sha256"] == sha256(f) == known_sha256(f)
    assert pub.weights_sha256 == result.weights_sha256 and known_weights(shards(out)) == result.weights_sha256
    size = sum(f.stat().st_size for f in shards(out))
    before = bytes_read()
    publish(base, out, tmp_path / "pub", report=report, force=True)  # its old links go: the records stay
    assert bytes_read() - before < size / 2
    assert all(known_sha256(f) == sha256(f) for f in shards(out)) and known_weights(shards(out)) is not None

    edit_in_place_keeping_size_and_mtime(shards(out)[0])
    with pytest.raises(CheckFailed, match="weights changed since port convert wrote them"):
        publish(base, out, tmp_path / "pub2", report=report)
    assert not (tmp_path / "pub2").exists()


def test_publish_copy_keeps_the_digest_of_what_it_copied(finetune: Path, tmp_path: Path, state: Path) -> None:
    out = tmp_path / "transformer"
    result = convert(finetune, out)
    base = build_demo_base(tmp_path / "base")
    publish(base, out, tmp_path / "pub", report=write_report(tmp_path / "reports", result.weights_sha256),
            link="copy")
    copied = tmp_path / "pub" / "transformer" / shards(out)[0].name
    assert copied.stat().st_ino != shards(out)[0].stat().st_ino
    assert known_sha256(copied) == sha256(copied)


def test_push_uses_the_proven_digests_and_refuses_a_folder_that_changed(finetune: Path, tmp_path: Path,
                                                                         state: Path) -> None:
    out = tmp_path / "transformer"
    result = convert(finetune, out)
    base = build_demo_base(tmp_path / "base")
    publish(base, out, tmp_path / "pub", report=write_report(tmp_path / "reports", result.weights_sha256))
    files, _ = local_identity(tmp_path / "pub")
    weights = [f for p, f in files.items() if p.startswith("transformer/") and p.endswith(".safetensors")]
    assert weights and all(f.proven for f in weights)  # the LFS oid is taken from them, not hashed once more

    victim = weights[0].file
    edit_in_place_keeping_size_and_mtime(victim)  # not described by its record any more: hashed again, refused
    with pytest.raises(CheckFailed, match="changed after port publish wrote it; nothing was uploaded"):
        local_identity(tmp_path / "pub")


def test_stale_records_are_swept(tmp_path: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `PRUNE_AT` records, the first record written in a process sweeps those whose file is gone or changed;
    the records of files still as they were stay."""
    from porting import known_digests

    files = [tmp_path / f"f{i}.bin" for i in range(4)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 100)
        file_sha256(f)
    monkeypatch.setattr(known_digests, "PRUNE_AT", 2)
    monkeypatch.setattr(known_digests, "_pruned", set())
    files[0].unlink()
    files[1].write_bytes(b"changed")
    extra = tmp_path / "new.bin"
    extra.write_bytes(b"new")
    file_sha256(extra)
    assert len(list((state / "digests").iterdir())) == 3  # f2, f3 and new
    assert all(known_sha256(f) == sha256(f) for f in files[2:] + [extra])


def test_identity_from_byte_ranges_equals_the_tensors_safetensors_loads(finetune: Path, tmp_path: Path) -> None:
    """Without records the identity is hashed from each tensor's byte range, without torch; it must name the same
    tensors safetensors' own loader returns (the oracle), whole or under a prefix."""
    import struct

    from safetensors.torch import load_file

    from porting.tensors.identity import WeightsHasher

    raw = finetune.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    oracle, part = WeightsHasher(), WeightsHasher()
    for key, tensor in load_file(str(finetune)).items():
        oracle.update(key, tensor, header[key]["dtype"])
        if key.startswith("double_blocks.0."):
            part.update(key[len("double_blocks.0."):], tensor, header[key]["dtype"])
    assert hash_checkpoint(open_source(finetune).view) == oracle.hexdigest()
    assert hash_checkpoint(open_source(finetune).view, prefix="double_blocks.0.") == part.hexdigest()


def test_a_file_changed_after_it_was_hashed_is_not_recorded(tmp_path: Path, state: Path) -> None:
    from porting.known_digests import remember

    f = tmp_path / "f.bin"
    f.write_bytes(b"a" * 10)
    hashed = f.stat()
    digest = sha256(f)
    f.write_bytes(b"b" * 10)  # changed between the hash and the record
    os.utime(f, ns=(hashed.st_atime_ns, hashed.st_mtime_ns + 1000))
    remember(f, digest, expect=hashed)
    assert known_sha256(f) is None
    remember(f, sha256(f), expect=f.stat())
    assert known_sha256(f) == sha256(f)


def identity_oracle(files: list[Path]) -> str:
    """The weights identity from the files' raw bytes and headers alone (no record, no flux-port reader)."""
    from porting.tensors.identity import WeightsHasher

    hasher = WeightsHasher()
    for f in files:
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for key, info in json.loads(raw[8:8 + n]).items():
            if key != "__metadata__":
                a, b = info["data_offsets"]
                hasher.add(key, info["dtype"], tuple(info["shape"]), sha256_bytes(raw[8 + n + a:8 + n + b]))
    return hasher.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_port_convert_is_a_copy_and_leaves_the_identity_to_the_first_verb_that_names_the_weights(
        finetune: Path, tmp_path: Path, state: Path, capsys: pytest.CaptureFixture) -> None:
    """Warm `port convert` after a fetch reads each source byte once (the kernel's copy) and hashes nothing: the
    tensors it splits have no recorded digest, so the weights identity is left to the first verb that names the
    weights (validate, publish), which takes it, hashing only those tensors, and records it for the others. An
    edit in place after that, size and modification time put back, is refused at publish's gate."""
    from porting.known_digests import remember

    src = tmp_path / "fetched.safetensors"
    src.write_bytes(finetune.read_bytes())
    remember(src, sha256(src), tensors=tensor_ranges(src))  # as port fetch leaves a verified download
    assert run_cli(["convert", str(src), "--out", str(tmp_path / "warm-up"), "--json"], capsys)[0] == 0
    size = src.stat().st_size
    before = bytes_read()
    code, out, err = run_cli(["convert", str(src), "--out", str(tmp_path / "out"), "--json"], capsys)
    read = bytes_read() - before
    assert code == 0, err
    assert json.loads(out)["weights_sha256"] is None  # deferred: not taken by convert
    assert size <= read < size * 1.15, f"port convert read {read} bytes of a {size}-byte checkpoint"
    files = shards(tmp_path / "out")
    assert known_weights(files) is None
    identity = open_source(tmp_path / "out").weights_sha256  # what validate and publish do first
    assert identity == identity_oracle(files) and known_weights(files) == identity
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    before = bytes_read()
    assert open_source(tmp_path / "out").weights_sha256 == identity
    assert bytes_read() - before - headers < 32 * 1024  # recorded for the others: no tensor read

    base = build_demo_base(tmp_path / "base")
    report = write_report(tmp_path / "reports", identity)
    publish(base, tmp_path / "out", tmp_path / "pub", report=report)
    edit_in_place_keeping_size_and_mtime(files[0])
    with pytest.raises(CheckFailed, match="validated other weights"):
        publish(base, tmp_path / "out", tmp_path / "pub2", report=report)
