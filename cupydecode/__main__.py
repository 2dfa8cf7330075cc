"""``python -m cupydecode``: the same command line as ``cupydecode``."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="cupydecode")
