"""The options model: every command's options declared once (families.py, one dataclass per family; mergekit's
flags in mergekit_flags.py's table), and what is generated from it (generate.py: the click options, the Python
API's keywords and checks; docs.py: docs/options.md), and the conversion of their values to the engine's
MergeOptions and RunControls (convert.py).

Part of the face layer: the command line and the Python API both import it; it imports neither.
"""

from .convert import parse_size, to_merge_options, to_run_controls
from .generate import api_defaults, api_values, click_options, command_opts, epilog
from .spec import Opt, option, reuse

__all__ = [
    "Opt",
    "api_defaults",
    "api_values",
    "click_options",
    "command_opts",
    "epilog",
    "option",
    "parse_size",
    "reuse",
    "to_merge_options",
    "to_run_controls",
]
