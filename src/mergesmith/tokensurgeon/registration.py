"""What tokensurgeon/ adds to the engine: the `transplant` and `transplant_merge` recipe ops, and the step
that plans `tokenizer_source: transplant:<donor>` in a merge config (merge.py).

Imported by the root package at start-up (see engine/extensions.py for why there), so it imports nothing
heavy: the ops and the step import table.py and merge.py only when a plan uses them.
"""

from __future__ import annotations

from ..engine.extensions import register_op, register_vocabulary_step
from .source import transplant_source

TYPE_CHECKING = False  # not `from typing import ...`: imported at start-up

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from ..config import MergeConfiguration
    from ..engine.extensions import PlanningView
    from ..engine.plan import InputRef, TensorRecipe
    from ..tokenizer.planning import TokenizerPlan

    Loader = Callable[[InputRef], torch.Tensor]

def transplant_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """An embedding/lm_head rebuilt for another tokenizer (table.py)."""
    from .table import transplant_op as run

    return run(recipe, load)


def transplant_merge_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """Inputs transplanted onto a donor's vocabulary, then merged (`tokenizer_source: transplant:<donor>`)."""
    from .merge import transplant_merge_op as run

    return run(recipe, load)


class TransplantStep:
    """`tokenizer_source: transplant:<donor>`: every model feeding the vocabulary tensors is transplanted onto
    the donor's vocabulary before the merge (merge.py). It stands in for the tokenizer step, which would read
    the source as a model's name."""

    name = "transplant"
    replaces = ("tokenizer",)

    def applies(self, config: MergeConfiguration) -> bool:
        return transplant_source(config) is not None

    def plan(self, planner: PlanningView, recipes: list[TensorRecipe]) -> TokenizerPlan:
        from .merge import plan_transplant

        return plan_transplant(planner, recipes, transplant_source(planner.config) or "")


register_op("transplant", transplant_op)
register_op("transplant_merge", transplant_merge_op)
register_vocabulary_step(TransplantStep())
