"""Nunchaku SVDQuant in one folder: `reader` (a file read as plain weights), `header` (its layers from the header),
`decode` (packed tensors to float), `tiles` (the packed layouts, `unpack_*` and `pack_*`), `quantize` (float to
SVDQuant), `layout` (the file's names and metadata), `comfy` (ComfyUI-nunchaku's spelling), `lite` (diffusers' own
Nunchaku folder read as plain weights), `relayout` (layers cut and joined between the two layouts)."""
