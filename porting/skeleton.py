"""A model's skeleton without memory: every parameter on the meta device, every buffer computed on the CPU.

Every place that builds a model only for its shapes or parameter count, or to fill it later, builds it here. This is
accelerate's `init_empty_weights(include_buffers=False)`, which patches parameter registration, not
`with torch.device("meta")`, which switches torch's default device: a module that Python first imports inside that
block makes its module-level tensors on the meta device for the rest of the process (diffusers'
`quantizers/bfl/utils.py` lookup table, after which every BFL-scheme nvfp4 dequantization fails). accelerate's
`include_buffers=True` is that same default-device switch, and its default reads ACCELERATE_INIT_INCLUDE_BUFFERS,
so it is passed explicitly. Buffers stay real: the models built here hold a few hundred bytes of them (rotary
frequencies, batch-norm statistics), and a skeleton at klein-9B or Qwen3-8B size adds tens of MB to the peak RSS
(tests/test_skeleton.py).

The patch is process-wide while the block runs: a module built in another thread at that moment gets meta
parameters too. flux-port builds models on one thread (its threads only hash files).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Within it, modules get their parameters on the meta device (no memory); buffers and any other tensor are made
    where they would be without it."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def diffusers_skeleton(cls: Any, config: Mapping[str, Any]) -> Any:
    """`cls.from_config(config)` (a diffusers model class; `_`-prefixed keys dropped) built in `empty_weights()`,
    with diffusers' notices about unused config keys silenced."""
    import logging
    import warnings

    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), empty_weights():
            warnings.simplefilter("ignore")
            return cls.from_config(clean)
    finally:
        log.setLevel(level)
