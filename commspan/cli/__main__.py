"""``python -m commspan.cli``: the ``commspan`` command."""

import sys

from commspan.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
