"""`python -m edgetrain ...`: the `edgetrain` command, for an environment whose scripts are not on PATH."""
import sys

from edgetrain.cli import main

sys.exit(main())
