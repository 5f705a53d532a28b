"""``python -m edgespec``: the same as the ``edgespec`` command."""
import sys

from .cli import main

sys.exit(main())
