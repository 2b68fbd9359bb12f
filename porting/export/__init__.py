"""Exports of a diffusers folder to other runtimes' formats (ONNX first)."""
