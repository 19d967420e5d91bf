"""``dvla sft``: supervised warm start of any policy on a demonstration dataset
(:mod:`dvla.app.sft.train`; its checkpoints: :mod:`dvla.app.sft.checkpoints`)."""

from dvla.app.sft.train import Job, main, train_sft

__all__ = ["Job", "main", "train_sft"]
