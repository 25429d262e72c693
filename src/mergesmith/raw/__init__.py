"""Raw merges: bare state dicts with no config.json or architecture, from files (`merge`) or memory (`in_memory`)."""
