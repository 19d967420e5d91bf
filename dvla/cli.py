"""The module of ``python -m dvla.cli`` (the ``dvla`` command; under torchrun ``-m dvla.cli
sft ...``): hands over to :mod:`dvla.app.cli`."""

import sys

from dvla.app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
