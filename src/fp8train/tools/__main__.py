"""`python -m fp8train.tools`: the same as the `fp8train` command."""

import sys

from .cli import main

sys.exit(main())
