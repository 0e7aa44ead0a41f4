"""EP dispatch/combine benchmark: epcc's CUDA bundles (through `epcc.runtime.Buffer`) against
torch+NCCL baselines and, where `import deep_ep` works, DeepEP.  Started by bench/ep_bench.py:

    torchrun --nproc-per-node 4 bench/ep_bench.py --bundles DIR [DIR ...] --out OUT_DIR
    torchrun --nproc-per-node 2 bench/ep_bench.py --bundles DIR --out OUT_DIR --dry-run --tokens 32

The method (timing, byte conventions, what each row times) is docs/benchmarking.md.  Modules,
lowest first:

* data.py: the workload (routing, token rows, expert outputs, references), the checks against
  the oracle, the bytes each convention counts;
* timing.py: the collectives (Comm), the per-iteration alignment and CUDA-event timing (Timer),
  warm-up / check / timed iterations, failure agreement between ranks;
* baselines.py: the torch+NCCL Megatron-style dispatcher and bare NCCL all_to_all;
* deepep.py: DeepEP's intranode Buffer, three dispatch variants and its combine (optional);
* epcc.py: epcc through `Buffer(group, bundle, backend="cuda")` (`"cpu"` in a dry run);
* child.py: the process per rank that runs epcc or DeepEP (a trapped kernel takes its CUDA
  context with it, not the benchmark's);
* predict.py: `epcc simulate`'s predictions (simulate.json, or a re-chunked plan simulated here);
* report.py: per-method summaries, the table, the prediction and timeline lines, JSON;
* cli.py: the arguments and main.

Importing the package forces NVLink multicast off before any module of it imports torch, and
makes `epcc` importable where it is not installed (the GPU machine).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# NVLink multicast must stay off on the shared GPU hosts: forced, not defaulted.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
OVERRIDDEN = {k: os.environ[k] for k, v in NO_MULTICAST.items() if os.environ.get(k, v) != v}
os.environ.update(NO_MULTICAST)

ROOT = Path(__file__).resolve().parents[2]


def import_epcc() -> None:
    """`import epcc` as installed (pip install -e .), or else alias the repository's folders as the
    package, as pyproject.toml's package-dir maps them (the GPU machine has no install)."""
    try:
        import epcc.plan  # noqa: F401 - the probe: is epcc installed (else its folders are aliased below)?
        return
    except ImportError:
        pass
    for name in [n for n in list(sys.modules) if n == "epcc" or n.startswith("epcc.")]:
        del sys.modules[name]
    for name, folder in (("epcc", "compiler"), ("epcc.runtime", "runtime"), ("epcc.backends", "backends")):
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        if "." in name:
            setattr(sys.modules["epcc"], name.split(".", 1)[1], mod)


import_epcc()
