"""Runners: what `validate` drives (a torch model stage by stage, an onnxruntime session whole)."""
