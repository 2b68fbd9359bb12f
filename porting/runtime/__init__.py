"""Running quantized checkpoints as they are stored, in plain torch, on whatever device the input is on.

`svdq_act`: Nunchaku's activation quantizers (int4 per 64, nvfp4 per 16), as the CUDA kernel rounds.
`svdq_linear`: `SvdqLinear`, one diffusers linear kept packed (4-bit codes, scales, low-rank factors).
`svdq_model`: `load_svdq_transformer`, a diffusers transformer whose quantized linears are `SvdqLinear`s.
"""
