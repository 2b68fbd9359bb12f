"""The onnxruntime runner: an exported transformer (`port export --format onnx`) run whole in one session.

Per-block localisation is not available: the graph has no stage boundaries a caller can stop at and feed, so the
report judges the final output only and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from porting.export.ort import SessionSettings, check_provider, model_path, open_session, require

from .base import WHOLE, State

ORT_FLOATS = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64}
NO_LOCALISATION = ("per-block localisation is not available through an ONNX graph: onnxruntime runs the exported "
                   "transformer as one graph with no block boundaries to stop at or feed, so only the final output "
                   "is judged; to find a bad block, validate the source weights with the torch runner")


class OrtRunner:
    runtime = "onnxruntime"
    localises = False
    localisation_note = NO_LOCALISATION

    def __init__(self, folder: Path, provider: str, dtype: torch.dtype,
                 forward_kwargs: Callable[[State], Mapping[str, Any]], graph: str | None = None,
                 settings: SessionSettings | None = None) -> None:
        """`forward_kwargs`: the family's inputs state as the diffusers forward's arguments, which are the graph's
        input names (`TransformerStages.forward_kwargs`). `graph`: the file to run when the folder holds several
        (a ryzenai export with several sizes); default model.onnx or the folder's one graph."""
        check_provider(provider)
        self.forward_kwargs = forward_kwargs
        self.folder, self.provider, self.dtype = Path(folder), provider, dtype
        self.device = f"onnxruntime:{provider}"
        self.graph = graph
        self.settings = settings or SessionSettings()
        self.session = open_session(self.folder, provider, graph, self.settings)
        self.inputs = [i.name for i in self.session.get_inputs()]
        # what the graph takes, not what the export is called: a ryzenai export holds bf16 weights but takes float32
        self.feed_dtypes = {i.name: ORT_FLOATS.get(i.type) for i in self.session.get_inputs()}
        first = self.session.get_inputs()[0].shape
        self.static_batch = first[0] if first and isinstance(first[0], int) else None
        # inputs with a batch dimension (FLUX.1's position ids have none)
        self.batched = {i.name for i in self.session.get_inputs()
                        if self.static_batch is not None and i.shape and i.shape[0] == self.static_batch}

    def stage_names(self) -> list[str]:
        return [WHOLE]

    def _feed(self, state: State) -> dict[str, np.ndarray]:
        feed = {}
        for name, value in self.forward_kwargs(state).items():
            if name not in self.inputs:
                continue
            if value.is_floating_point():
                value = value.to(self.feed_dtypes.get(name) or self.dtype)
            feed[name] = value.detach().cpu().contiguous().numpy()
        return feed

    def run(self, stage: str, states: list[State]) -> list[State]:
        if stage != WHOLE:
            raise ValueError(f"the onnxruntime runner has the single stage {WHOLE!r}, not {stage!r}")
        return [{"out": self._run(s)} for s in states]

    def _run(self, state: State) -> torch.Tensor:
        feed = self._feed(state)
        batch = next(iter(feed.values())).shape[0]
        if self.static_batch is None or batch == self.static_batch:
            return torch.from_numpy(self.session.run(None, feed)[0])
        # a static batch-1 graph (--target ryzenai): one case at a time
        parts = [self.session.run(None, {k: v[i:i + 1] if k in self.batched else v for k, v in feed.items()})[0]
                 for i in range(batch)]
        return torch.from_numpy(np.concatenate(parts))

    def facts(self) -> dict[str, Any]:
        ort = require("onnxruntime")
        return {"runtime": "onnxruntime", "onnxruntime": ort.__version__, "provider": self.provider,
                "session_providers": self.session.get_providers(),
                "available_providers": ort.get_available_providers(), "model": str(model_path(self.folder, self.graph)),
                "session": {"threads": self.settings.threads, "lean": self.settings.lean},
                "inputs": self.inputs}
