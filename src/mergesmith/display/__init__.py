"""Progress displays: the terminal bar and plain lines (`terminal`), and the notebook bar (`notebook`)."""
