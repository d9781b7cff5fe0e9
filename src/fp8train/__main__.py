"""`python -m fp8train`: the `fp8train` command, which lives in the toolbox (fp8train.tools)."""

import sys

from .tools.cli import main

sys.exit(main())
