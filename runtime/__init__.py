"""epcc runtime: loads compiled bundles on the machines that run them (no MLIR, no jinja2 needed).

* buffer.py: `epcc.runtime.Buffer`, the DeepEP-shaped API; it hands each call to an engine;
* engines/: what runs each shape of plan (engines/base.py: how they are driven);
* layout/: the token-level layout every engine executes, computed from the plan and the routing;
* build_cache.py: the one place libraries are compiled (nvcc, cc) and cached;
* shm.py (peer memory between processes), routing.py (top-k arrays), bf16.py (bfloat16 in NumPy);
* testing/: inputs, the oracle and NumPy executors that check a run (`epcc run`, bench/, tests);
* tune.py: `epcc tune`, the direct kernels' launch configuration swept on the GPUs;
* native/: the C library `epcc_rt` (built by CMakeLists.txt): bounded waits on acquire/release
  flags that report the rank, step and flag instead of hanging.
"""
