"""Building a Plan: the merge-config planner, mergekit's `modules:` form, the layer map of any architecture,
per-tensor parameters, and what every planner shares (options, shards, estimates, seeds)."""
