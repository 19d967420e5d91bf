"""The module of ``torchrun -m dvla.launch`` and ``python -m dvla.launch``: every rank of a job
runs it, and it hands over to the training application (:mod:`dvla.app.train`, the same as
``dvla train``; ``-m dvla.launch sft ...`` is ``dvla sft``, :mod:`dvla.app.sft`).

    python -m dvla.launch --preset debug run.iterations=5
    torchrun --standalone --nproc_per_node=2 -m dvla.launch --preset fast_reach
    torchrun --standalone --nproc_per_node=2 -m dvla.launch sft --data DATASET
"""

import sys

from dvla.app.train import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
