"""python -m gateway: the same as the `gateway` command."""

import sys

from .tools.cli import main

sys.exit(main())
