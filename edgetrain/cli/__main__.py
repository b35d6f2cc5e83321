import sys

from edgetrain.cli import main

sys.exit(main())
