"""epcc runtime: loads compiled bundles on the machines that run them (no MLIR needed).

runtime/native/ holds the C library `epcc_rt` (built by CMakeLists.txt): bounded waits on
acquire/release flags that report the rank, step and flag instead of hanging.
"""
