"""``python -m relserve.loadtest`` — see :mod:`relserve.loadtest.cli`."""

import sys

from .cli import main

sys.exit(main())
