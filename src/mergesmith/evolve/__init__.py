"""`mergesmith evolve`: evolutionary merge search over mergekit-evolve genomes (CMA-ES), resumable.

config.py (genome + tasks file) -> genome.py (vector <-> merge config) -> candidates.py (merge by the
engine, in memory or in one reused directory) -> evaluators.py (built-in tasks) -> scoring.py (local or
Ray) -> search.py (CMA-ES loop, journal.py) -> plot.py/display.py/command.py (what a user sees).
"""

from .search import SearchOptions, SearchResult, run_search

__all__ = ["SearchOptions", "SearchResult", "run_search"]
