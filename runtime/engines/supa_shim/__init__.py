"""The SUPA target's kernels on NVIDIA GPUs through the SUPA-on-CUDA shim (engine.py): what
`Buffer(group, bundle, backend="supa")` runs when EPCC_SUPA_SHIM=1 (runtime/buffer.py decides)."""
