"""The streaming writer: file-to-file copies and in-memory tensors give the same bytes and the same identity."""

from __future__ import annotations

import json
import os

import pytest
import torch

from porting.engine.convert import convert, prepare
from porting.errors import InputError
from porting.tensors.checkpoint import hash_checkpoint, open_checkpoint
from porting.tensors.writer import Entry, Segments, WeightsHasher, write_shards

from .helpers import assert_same_tensors, load_folder


def test_manifest_identity_matches_a_fresh_hash_of_the_output(tmp_path, tiny2_file):
    """Row moves are copied and hashed on a second thread; casts go through memory. Both record the identity
    that `hash_checkpoint` recomputes from the written files."""
    for name, dtype in (("copied", "keep"), ("cast", "fp32")):
        result = convert(tiny2_file, tmp_path / name, dtype=dtype)
        manifest = json.loads((tmp_path / name / "flux-port.json").read_text())
        assert manifest["weights_sha256"] == result.weights_sha256
        assert hash_checkpoint(open_checkpoint(tmp_path / name)) == result.weights_sha256
    # the bf16 -> fp32 conversion holds the same values as the copied bf16 one
    copied, cast = load_folder(tmp_path / "copied"), load_folder(tmp_path / "cast")
    assert_same_tensors({k: v.float() for k, v in copied.items()}, cast)


def test_copied_pieces_give_the_same_bytes_and_identity_as_tensors(tmp_path, monkeypatch):
    """Byte ranges out of order, across read-piece boundaries and at odd offsets, written next to in-memory
    tensors: the file holds exactly those bytes and the identity is the one computed from the tensors."""
    from safetensors.torch import load_file

    from porting.tensors import writer

    monkeypatch.setattr(writer, "READ_PIECE", 4096)  # many pieces per tensor, and a piece shorter than the rest
    monkeypatch.setattr(writer, "READ_AHEAD", 3 * 4096)
    src = tmp_path / "src.bin"
    data = os.urandom(3 * 2**20 + 18)
    src.write_bytes(data)
    parts = ((src, 2**20, 2**20 + 6), (src, 0, 2**20), (src, 3 * 2**20, 18))
    expected = torch.frombuffer(bytearray(b"".join(data[o:o + n] for _, o, n in parts)), dtype=torch.uint8)
    middle = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    entries = [Entry("a", (expected.numel(),), "U8"), Entry("b", (3, 4), "F32"), Entry("c", (17,), "U8")]
    last = (src, 5, 17)
    hasher = WeightsHasher()
    names = write_shards(tmp_path, "out", entries, [Segments(parts, "a"), middle, Segments((last,), "c")],
                         2**40, hasher=hasher)
    got = load_file(str(tmp_path / names[0]))
    assert torch.equal(got["a"], expected) and torch.equal(got["b"], middle)
    assert got["c"].numpy().tobytes() == data[5:22]
    assert hasher.hexdigest() == hash_checkpoint(open_checkpoint(tmp_path / names[0]))


def test_a_short_source_is_an_error_naming_the_file_and_tensor(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100)
    with pytest.raises(InputError, match="src.bin: unexpected end of file while reading tensor 'w'"):
        write_shards(tmp_path, "out", [Entry("k", (200,), "U8")], [Segments(((src, 0, 200),), "w")], 2**40)


def test_the_read_ahead_is_bounded_by_bytes_and_a_stopped_writer_stops_its_reader(tmp_path, monkeypatch):
    """However many tensors are queued, the second thread holds at most READ_AHEAD bytes beyond one piece; when
    the writer fails mid-way, the reading thread ends instead of waiting for room forever."""
    import threading

    from porting.tensors import writer
    from porting.tensors.prefetch import ByteBudget

    peak = []
    real_take = ByteBudget.take

    def take(self, n):
        ok = real_take(self, n)
        peak.append(self.used)
        return ok

    monkeypatch.setattr(ByteBudget, "take", take)
    monkeypatch.setattr(writer, "READ_AHEAD", 1000)
    tensors = [torch.full((100,), float(i)) for i in range(40)]  # 400 bytes each
    entries = [Entry(f"t{i}", (100,), "F32") for i in range(40)]
    write_shards(tmp_path, "ok", entries, tensors, 2**40)
    assert max(peak) <= 1000 + 400
    fails = iter(range(40))

    def on_bytes(n):
        if next(fails) == 3:
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_shards(tmp_path, "bad", entries, tensors, 2**40, on_bytes=on_bytes)
    assert not any(t.name == "flux-port-prefetch" for t in threading.enumerate())


def test_read_returns_exact_tensors_and_row_ranges(tmp_path, tiny2_file):
    ckpt = open_checkpoint(tiny2_file)
    from safetensors.torch import load_file

    ref = load_file(str(tiny2_file))
    for key, tensor in ref.items():
        assert torch.equal(ckpt.read(key), tensor)
    key = "double_blocks.0.img_attn.qkv.weight"
    assert torch.equal(ckpt.read(key, rows=(64, 128)), ref[key][64:128])


def test_the_output_follows_the_source_storage_order(tmp_path, tiny2_file):
    """The source is read front to back: the output's tensor order is the source's storage order."""
    convert(tiny2_file, tmp_path / "out", strict=True)
    src = open_checkpoint(tiny2_file).tensors
    out = open_checkpoint(tmp_path / "out").tensors
    _, _, plan = prepare(tiny2_file)
    source_of = {t: ps.stored_sources[0] for ps in plan.steps for t in ps.step.targets}
    in_output_order = sorted(out, key=lambda k: out[k].start)
    starts = [src[source_of[k]].start for k in in_output_order]
    assert starts == sorted(starts)


def _write_pieces(tmp_path, items, entries, **kwargs):
    hasher = WeightsHasher()
    names = write_shards(tmp_path, "out", entries, items, 2**40, hasher=hasher, **kwargs)
    return tmp_path / names[0], hasher.hexdigest()


def test_adjacent_copied_tensors_are_copied_as_one_run_with_the_same_bytes_and_identity(tmp_path, monkeypatch):
    """Tensors whose source ranges follow each other go to the kernel as one copy; a tensor from memory or a jump
    in the source ends the run. The file holds the same tensors, and the identity is the one computed per tensor,
    as when each tensor is written from memory."""
    from safetensors.torch import load_file

    from porting.tensors import writer

    src = tmp_path / "src.bin"
    data = os.urandom(8192 + 600)
    src.write_bytes(data)
    calls: list[tuple[int, int]] = []
    real = os.copy_file_range

    def counted(src_fd, dst_fd, count, offset_src=None, *args):
        calls.append((offset_src, count))
        return real(src_fd, dst_fd, count, offset_src, *args)

    monkeypatch.setattr(writer.os, "copy_file_range", counted)
    ranges = [(8, 100), (108, 4000), (4108, 92), (0, 8), (4200, 4000)]  # three adjacent, a jump, one in memory
    entries = [Entry(f"t{i}", (n,), "U8") for i, (_, n) in enumerate(ranges)]
    memory = torch.frombuffer(bytearray(data[4200:8200]), dtype=torch.uint8)
    items = [Segments(((src, o, n),), f"t{i}") for i, (o, n) in enumerate(ranges[:4])] + [memory]
    progress: list[int] = []
    out, identity = _write_pieces(tmp_path, items, entries, on_bytes=progress.append)
    if writer._Copier().kernel:  # where the kernel copies at all
        assert calls == [(8, 4192), (0, 8)]
    got = load_file(str(out))
    for i, (o, n) in enumerate(ranges):
        assert got[f"t{i}"].numpy().tobytes() == data[o:o + n]
    assert sum(progress) == sum(n for _, n in ranges)
    (tmp_path / "ref").mkdir()
    tensors = [torch.frombuffer(bytearray(data[o:o + n]), dtype=torch.uint8) for o, n in ranges]
    ref, ref_identity = _write_pieces(tmp_path / "ref", tensors, entries)
    assert identity == ref_identity == hash_checkpoint(open_checkpoint(out))
    assert load_file(str(ref)).keys() == got.keys()


def test_the_header_is_padded_so_copied_data_keeps_its_place_in_a_folio(tmp_path):
    """The data starts at the first copied tensor's offset modulo 64 KiB (the kernel then copies whole folios), and
    stays 8-byte aligned: a source offset that is not is not followed. Either file loads in safetensors."""
    from safetensors import safe_open

    from porting.tensors.writer import FOLIO

    src = tmp_path / "src.bin"
    data = os.urandom(FOLIO + 8192)
    src.write_bytes(data)
    for offset, aligned_to_source in ((FOLIO + 1000, True), (FOLIO + 1001, False)):
        folder = tmp_path / str(offset)
        folder.mkdir()
        out, _ = _write_pieces(folder, [Segments(((src, offset, 512),), "w")], [Entry("w", (512,), "U8")])
        start = 8 + int.from_bytes(out.read_bytes()[:8], "little")
        assert start % 8 == 0
        assert (start % FOLIO == offset % FOLIO) is aligned_to_source
        with safe_open(str(out), "pt") as f:
            assert f.get_tensor("w").numpy().tobytes() == data[offset:offset + 512]


def test_a_short_source_in_a_run_names_the_tensor_whose_bytes_ran_out(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 100)
    entries = [Entry("a", (50,), "U8"), Entry("b", (100,), "U8")]
    items = [Segments(((src, 0, 50),), "first"), Segments(((src, 50, 100),), "second")]
    with pytest.raises(InputError, match="src.bin: unexpected end of file while reading tensor 'second'"):
        write_shards(tmp_path, "out", entries, items, 2**40)


def test_a_long_run_is_copied_as_it_grows_and_reported_as_copied(tmp_path, monkeypatch):
    """A run longer than one copy call goes out a call at a time while later tensors still join it; progress is
    told after each call, and the file holds the same bytes."""
    from safetensors.torch import load_file

    from porting.tensors import writer

    monkeypatch.setattr(writer, "COPY_MAX", 1000)
    src = tmp_path / "src.bin"
    data = os.urandom(5000)
    src.write_bytes(data)
    ranges = [(0, 700), (700, 1500), (2200, 2800)]
    entries = [Entry(f"t{i}", (n,), "U8") for i, (_, n) in enumerate(ranges)]
    items = [Segments(((src, o, n),), f"t{i}") for i, (o, n) in enumerate(ranges)]
    progress: list[int] = []
    out, identity = _write_pieces(tmp_path, items, entries, on_bytes=progress.append)
    assert progress == [1000] * 5
    got = load_file(str(out))
    for i, (o, n) in enumerate(ranges):
        assert got[f"t{i}"].numpy().tobytes() == data[o:o + n]
    assert identity == hash_checkpoint(open_checkpoint(out))
