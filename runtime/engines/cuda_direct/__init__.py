"""The direct one-hop kernels on NVIDIA GPUs (`Buffer(..., backend="cuda")`).

* library.py: the generated `<schedule>_direct.cu` built through the build cache, loaded with
  ctypes (DirectLibrary), its argument block and error record, the role timeline;
* engine.py: the Engine of Buffer's cuda backend: the peer region, IPC handles over the group,
  dispatch and combine on the current torch stream, the launch configuration (tuned.json).
"""
