"""``python -m commspan.cli``: the ``commspan`` command."""

import sys

if __name__ == "__main__":  # pragma: no cover
    try:  # (Ctrl-C while the package loads: no traceback, status 130)
        from commspan.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("commspan: interrupted\n")
        sys.exit(130)
    sys.exit(main())
