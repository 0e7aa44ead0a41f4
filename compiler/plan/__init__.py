"""The plan: what the compiler decided, as plain data the simulator, the backends and the runtime read.

* model.py: the data model (Plan, its steps and flows, kernels, buffers, workload), JSON in
  and out (plan.json in a bundle);
* rdma.py: which steps are RDMA steps and how they are chunked (the proxy loop's and the GPU
  proxy path's shape), with the run-time overrides of chunk size and depth;
* direct.py: which plans lower to the CUDA target's direct one-hop kernels and their shape
  (launch configuration, launches, metadata passes);
* bundle.py: the one writer and the one loader of a compiled bundle (plan.json, manifests, the
  sha256 of every file);
* schema.py: the formats and versions of a bundle's JSON files, and a checker of JSON against a
  schema; check.py (plan.json field by field), invariants.py (what the compiler proved about a
  plan, re-checked at load), cuda_manifest.py (cuda/manifest.json).

Nothing here needs MLIR, lark or jinja2: a GPU machine reads bundles with it.
"""

from .model import (WARPS_PER_SM, BufferPlan, DirectKernels, Flow, KernelPlan, LaunchPlan, Plan, PlanStep,
                    RolePlan, WorkloadPlan, chunk_sizes, ramp_sizes)

__all__ = ["WARPS_PER_SM", "BufferPlan", "DirectKernels", "Flow", "KernelPlan", "LaunchPlan", "Plan", "PlanStep",
           "RolePlan", "WorkloadPlan", "chunk_sizes", "ramp_sizes"]
