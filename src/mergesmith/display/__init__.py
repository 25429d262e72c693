"""Progress displays: the terminal bar and plain lines (`terminal`), the notebook bar (`notebook`), what a
command that writes a model shows around its run (`command_output`) and Ctrl-C handling (`interrupts`)."""
