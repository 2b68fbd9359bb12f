"""Every tiny offline base, by the publish variant it stands for: one call builds a base folder and names the
transformer config (and the family table) a tiny fine-tune of it needs.

    from porting.demo.bases import write_tiny_base, tiny_base
    base = write_tiny_base(tmp / "base", "flux1-dev", seed=0)
    write_random_checkpoint(tmp / "ft.safetensors", tiny_base("flux1-dev").transformer, table="flux1", seed=1)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class TinyBase:
    variant: str  # the publish variant (porting.families pipeline_variants) the base stands for
    demo: str  # its name for `port demo --family`
    family: str  # the family (and mapping table) of its transformer
    title: str
    components: str  # what the base holds, in words, for the demo's output
    build: Callable[[Path, int], Path]
    transformer: Mapping[str, Any]  # the transformer config a fine-tune must have to fit the base


def _klein(folder: Path, seed: int) -> Path:
    from .tinypipe import build_demo_base
    return build_demo_base(folder, seed)


def _klein_wide(folder: Path, seed: int) -> Path:
    from .tinypipe import build_demo_base
    return build_demo_base(folder, seed, wide=True)


def _flux1(guidance: bool) -> Callable[[Path, int], Path]:
    def build(folder: Path, seed: int) -> Path:
        from .tinypipe_flux1 import build_base
        return build_base(folder, seed, guidance=guidance)
    return build


def _flux2_dev(folder: Path, seed: int) -> Path:
    from .tinypipe_flux2dev import build_base
    return build_base(folder, seed)


def _configs() -> dict[str, Mapping[str, Any]]:
    # the same dicts the builders check against their components (imports torch-free family data only)
    from porting.families.flux1 import TINY as FLUX1
    from porting.families.flux2 import TINY as FLUX2
    wide = {**FLUX2, "attention_head_dim": 64, "joint_attention_dim": 384, "axes_dims_rope": [16, 16, 16, 16]}
    return {"klein": FLUX2, "klein-wide": wide, "flux1-dev": {**FLUX1, "guidance_embeds": True},
            "flux1-schnell": {**FLUX1, "guidance_embeds": False}, "dev": {**FLUX2, "guidance_embeds": True}}


def tiny_bases() -> dict[str, TinyBase]:
    c = _configs()
    return {
        "klein": TinyBase("klein", "klein", "flux2", "FLUX.2 [klein]", "Qwen3 text encoder, tokenizer, VAE, scheduler",
                          _klein, c["klein"]),
        "klein-wide": TinyBase("klein", "klein-wide", "flux2", "FLUX.2 [klein], widths multiples of 128 (Nunchaku "
                               "4-bit ready)", "Qwen3 text encoder, tokenizer, VAE, scheduler", _klein_wide,
                               c["klein-wide"]),
        "flux1-dev": TinyBase("flux1-dev", "flux1", "flux1", "FLUX.1 [dev]",
                              "CLIP + T5 text encoders and tokenizers, VAE, scheduler", _flux1(True), c["flux1-dev"]),
        "flux1-schnell": TinyBase("flux1-schnell", "flux1-schnell", "flux1", "FLUX.1 [schnell]",
                                  "CLIP + T5 text encoders and tokenizers, VAE, scheduler", _flux1(False),
                                  c["flux1-schnell"]),
        "dev": TinyBase("dev", "flux2-dev", "flux2", "FLUX.2 [dev]", "Mistral3 text encoder, tokenizer, VAE, scheduler",
                        _flux2_dev, c["dev"]),
    }


def tiny_base(variant: str) -> TinyBase:
    bases = tiny_bases()
    if variant not in bases:
        raise KeyError(f"no tiny base for variant {variant!r} (known: {', '.join(bases)})")
    return bases[variant]


def demo_bases() -> dict[str, TinyBase]:
    """The tiny bases by their `port demo --family` name (klein, flux1, flux1-schnell, flux2-dev)."""
    return {b.demo: b for b in tiny_bases().values()}


def write_tiny_base(folder: str | Path, variant: str = "klein", seed: int = 0) -> Path:
    """Build the tiny base of a publish variant (klein, flux1-dev, flux1-schnell, dev) in `folder`, offline."""
    return tiny_base(variant).build(Path(folder), seed)
