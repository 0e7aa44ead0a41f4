"""The `epcc` command line, one module per command:

* main.py: the parser and `main` (exit statuses 0 ok, 1 user error, 2 bad usage, 3 internal
  error; every error printed as one message);
* check.py, compile.py, viz.py, simulate.py, tune.py, run.py: each command's options and what it
  does; options.py the options several share, common.py printing and user errors.

What a command does beyond reading options and printing lives below it: the pipeline, the bundle
writer and loader (epcc.plan.bundle), the simulator, the runtime and the run checker
(epcc.runtime.testing.check).
"""

from .main import main
from .run import RUN_BACKENDS

__all__ = ["RUN_BACKENDS", "main"]
