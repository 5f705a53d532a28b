"""``python -m edgespec``: the same as the ``edgespec`` command."""
import sys

from .cli import console_main

sys.exit(console_main())
