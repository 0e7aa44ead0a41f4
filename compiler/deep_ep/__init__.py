"""`epcc.deep_ep`: DeepEP V1's intranode Python API (normal mode) over epcc's token-major bundles.

    import epcc.deep_ep as deep_ep
    buffer = deep_ep.Buffer(group, num_nvl_bytes)        # bundles from $EPCC_DEEP_EP_BUNDLES

Code written for `deep_ep.Buffer` runs unchanged; for code that says `import deep_ep`, put a
directory on PYTHONPATH holding a file deep_ep.py with the one line `from epcc.deep_ep import *`
(docs/runtime.md, "epcc.deep_ep").  buffer.py says how each call runs and what is not supported,
bundles.py how a bundle is chosen.
"""

from .buffer import Buffer, Handle
from .bundles import BUNDLES_ENV, COMPILE_ENV, NoBundle
from .utils import Config, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "Handle", "NoBundle", "BUNDLES_ENV", "COMPILE_ENV"]
