"""EP dispatch/combine benchmark (the package bench/ep_bench/; docs/benchmarking.md):

    torchrun --nproc-per-node 4 bench/ep_bench.py --bundles DIR [DIR ...] --out OUT_DIR
    torchrun --nproc-per-node 2 bench/ep_bench.py --bundles DIR --out OUT_DIR --dry-run --tokens 32
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package bench/ep_bench/ (also for spawned children)
from ep_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
