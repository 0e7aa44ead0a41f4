"""`python -m epcc.cli`: the `epcc` command."""

import sys

from .main import main

sys.exit(main())
