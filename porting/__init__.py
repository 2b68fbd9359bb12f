"""flux-port: port FLUX.2 / FLUX.1 checkpoints to diffusers, with numerical proof."""

__version__ = "0.1.0"
