"""``python -m qformats``: the command line is :mod:`qformats._cli`, its analysis :mod:`qformats._cli._engine`."""

from qformats._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
