"""``python -m relserve.client``: the ``relserve call`` command line (:mod:`relserve.client.cli`), for an
environment with the client only."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m relserve.client"))
