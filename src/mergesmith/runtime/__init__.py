"""What tunes the process, not the merge: devices, memory limits and release, caches, warm start, import read-ahead."""
