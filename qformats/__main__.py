"""``python -m qformats``: see :mod:`qformats._cli`."""

from qformats._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
