"""Lowering of the checked schedule model to the `epcc` MLIR dialect (ops.py builds, emit.py lowers)."""
