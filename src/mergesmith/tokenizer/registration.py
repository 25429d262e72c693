"""What tokenizer/ adds to the engine: the `vocab_merge` recipe op and the tokenizer planning step.

Imported by the root package at start-up (see engine/extensions.py for why there), so it imports nothing
heavy: the op and the step import align.py and planning.py (torch, and transformers when a tokenizer is
built) only when a plan uses them.
"""

from __future__ import annotations

from ..engine.extensions import register_op, register_vocabulary_step

TYPE_CHECKING = False  # not `from typing import ...`: imported at start-up

if TYPE_CHECKING:
    import torch

    from ..config import MergeConfiguration
    from ..engine.extensions import Loader, PlanningView
    from ..engine.plan import TensorRecipe
    from .planning import TokenizerPlan


def vocab_merge_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """Embedding/lm_head rows re-indexed to the output vocabulary, then merged (align.py)."""
    from .align import merge_vocabulary

    return merge_vocabulary(recipe, load)


class TokenizerStep:
    """A `tokenizer` section, `tokenizer_source` or `chat_template`: build the output tokenizer and re-index
    the vocabulary tensors onto it (planning.py)."""

    name = "tokenizer"
    replaces: tuple[str, ...] = ()

    def applies(self, config: MergeConfiguration) -> bool:
        return config.tokenizer is not None or bool(config.tokenizer_source) or bool(config.chat_template)

    def plan(self, planner: PlanningView, recipes: list[TensorRecipe]) -> TokenizerPlan:
        from .planning import plan_tokenizer  # imports transformers only for such configs

        return plan_tokenizer(planner, recipes)


register_op("vocab_merge", vocab_merge_op)
register_vocabulary_step(TokenizerStep())
