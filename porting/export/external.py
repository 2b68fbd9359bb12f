"""Writing ONNX external data: where each tensor starts in a `.data` file, and saving a graph whose weights are
already there (the streamed exports: porting/export/ryzenai.py, streamed.py, streamed_text.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# external data layout: a tensor of at least 1 MiB starts on a 64 KiB boundary (onnx's `allocation_granularity`, the
# largest mmap granularity: Windows'), so onnxruntime can map it from the file instead of copying it; smaller ones on 64
ALIGN_THRESHOLD, ALIGN_LARGE, ALIGN_SMALL = 2**20, 2**16, 64


def padding(offset: int, size: int) -> int:
    """Zero bytes to write at `offset` before a tensor of `size` bytes in an external data file."""
    return (-offset) % (ALIGN_LARGE if size >= ALIGN_THRESHOLD else ALIGN_SMALL)



def save_streamed(proto: Any, dest: Path, file: str, data_file: str | None = None) -> None:
    """Save a graph whose weights already sit in `data_file` (default `file`.data); the folded constants over 1 KB
    that the graph still holds inline are appended to it (as `save` does), the smaller ones stay in the graph."""
    import onnx
    from onnx import TensorProto, external_data_helper

    data_file = data_file or file + ".data"
    data_path = dest / data_file
    with open(data_path, "ab") as data:
        offset = data.tell()
        for t in proto.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL or not t.HasField("raw_data") or len(t.raw_data) <= 1024:
                continue
            pad = padding(offset, len(t.raw_data))
            data.write(b"\0" * pad)
            offset += pad
            raw = t.raw_data
            data.write(raw)
            external_data_helper.set_external_data(t, data_file, offset, len(raw))
            t.data_location = TensorProto.EXTERNAL
            t.ClearField("raw_data")
            offset += len(raw)
    onnx.save_model(proto, str(dest / file))
    onnx.checker.check_model(str(dest / file))
