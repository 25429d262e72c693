"""mergesmith: merge language-model checkpoints as a plan of tensor recipes, streamed to disk."""

__version__ = "0.1.0"
