"""What checks a run of a plan: deterministic inputs, the oracle, and executors to compare with.

* inputs.py: seeded routings, routing weights, payload rows and expert outputs;
* oracle.py: what dispatch and combine must produce (plain NumPy, no plan), and the comparison;
* compare_torch.py: the oracle's combine comparison on torch tensors where they are (the GPU
  checks), the same verdict;
* reference.py: a NumPy executor of a layout, copy by copy (`epcc run --backend reference`);
* check.py: a run against the oracle, in words (the first differing rank, token and expert; the
  combine's error summary) and the memory such a run holds (`epcc run`);
* emulate.py: a NumPy emulator of the table-driven CUDA kernels over the same table blobs the
  GPU reads (bench/ep_bench.py --dry-run, the tests);
* ranks.py: processes joined as torchrun joins its workers, with every rank's own exit status
  (torchrun's own is 1 whether a rank exited 1 or crashed); `spawn_ranks`, a function per rank in
  spawned processes under one deadline (the runtime tests' multi-process cases).

Used by `epcc run`, bench/ and the tests; no engine imports it.
"""
