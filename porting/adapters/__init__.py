"""Adapters (LoRA, LyCORIS LoKr / LoHa, ComfyUI full differences) for the models the mapping tables describe.

`naming` reads adapter keys into modules of a mapping table, `delta` computes weight differences, `merge` adds them
to a base checkpoint, `transform` and `convert` carry adapters between namings, `describe` is `port inspect`.
"""

LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights(folder) looks for
MANIFEST = "flux-port-adapter.json"  # written by port convert next to a converted adapter
