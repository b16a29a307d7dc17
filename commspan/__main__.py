"""``python -m commspan``: the ``commspan`` command (as ``python -m commspan.cli``)."""

import sys

from commspan.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
