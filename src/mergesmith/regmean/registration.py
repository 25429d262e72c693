"""What regmean/ adds to the engine: the data step that collects the Gram matrices a `regmean` merge needs.

Imported by the root package at start-up (see engine/extensions.py for why there), so it imports nothing heavy:
planning.py and collect.py (torch, transformers) are imported only when a plan uses them.
"""

from __future__ import annotations

from ..engine.extensions import register_data_step

TYPE_CHECKING = False  # not `from typing import ...`: imported at start-up

if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from ..config import MergeConfiguration
    from ..engine.extensions import PlanningView
    from ..engine.plan import Plan, TensorRecipe
    from ..io.checkpoint import Checkpoint
    from .planning import RegmeanPlan


class RegmeanStep:
    """`merge_method: regmean`: collect each model's Grams on the calibration text before the merge."""

    name = "regmean"

    def applies(self, config: MergeConfiguration) -> bool:
        return config.merge_method == "regmean"

    def plan(self, planner: PlanningView, recipes: list[TensorRecipe]) -> RegmeanPlan:
        from .planning import plan_regmean

        return plan_regmean(planner, recipes)

    def prepare(
        self, plan: Plan, checkpoints: dict[str, Checkpoint], out_dir: Path, stop: threading.Event | None
    ) -> dict[str, Checkpoint]:
        from .collect import collect_grams

        return collect_grams(plan.options["regmean"], out_dir, stop)

    def finish(self, out_dir: Path) -> None:
        from .store import remove_store

        remove_store(out_dir)


register_data_step(RegmeanStep())
