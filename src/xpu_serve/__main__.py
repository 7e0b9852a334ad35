"""`python -m xpu_serve` runs the CLI."""

import sys

from xpu_serve.cli import main

sys.exit(main())
