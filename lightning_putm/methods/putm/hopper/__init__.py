"""PUTM's E-step as one CUDA kernel for Hopper GPUs (H100, H200): design B, being built (not yet a ``solver``).

One block of 8 warps runs every Adam step of one task's E-step with the navigator's bf16 weights and inputs in shared
memory and the products on the tensor cores (``e_step.cu``). :mod:`.build` compiles it for sm_90a with NVRTC (from
torch's CUDA wheels; no GPU needed to compile), :mod:`.layout` holds its shapes and fragment layout, :mod:`.emulate`
replays its arithmetic with torch on any device (the CPU check of its numerics), :mod:`.launch` runs it on a GPU
through the driver API. ``tools/hopper_sass.py`` counts its instructions per Adam step. docs/design.md ("The Hopper
kernel") says why it is written this way.
"""
