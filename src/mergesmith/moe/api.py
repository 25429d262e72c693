"""The MoE Python API: plan an assembly from headers, then compute router weights and write it.

Writing goes through `engine.run.execute_plan`, the output protocol every planner shares, so an MoE
assembly resumes after an interruption, checks the disk and reports progress like a merge.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.plan import Plan
from ..engine.planning.shared import MergeOptions
from ..engine.run import MergeResult, RunControls, reuse_or_draw_seed, run_planned
from ..errors import OutputError
from ..io.checkpoint import Checkpoint
from ..io.journal import Journal, foreign_entries, refuse_non_directory
from .config import MoEConfiguration, load_moe_config, validate_moe_config
from .planner import MoEPlanner
from .router import ROUTER_MODEL, GateJob, GateProgress


def build_moe_plan(
    config: str | Path | MoEConfiguration,
    options: MergeOptions | None = None,
    out_dir: str | Path | None = None,
    *,
    allow_all_same: bool = False,
) -> tuple[Plan, dict[str, Checkpoint], GateJob]:
    """Plan an MoE assembly from headers alone (no forward pass; router weights are computed later).

    When the config needs randomness (random gates, expert noise) and no seed is given, reuse the
    seed an interrupted run in `out_dir` recorded (so it resumes), or draw and record a new one.
    """
    options = options or MergeOptions()
    if isinstance(config, MoEConfiguration):
        validate_moe_config(config, allow_all_same=allow_all_same)
        cfg, source = config, "config"
    else:
        cfg = load_moe_config(config, allow_all_same=allow_all_same, strict=options.strict)
        source = str(config)
    if cfg.needs_seed():
        reuse_or_draw_seed(options, out_dir)
    checkpoints = {ref: options.open_input(ref) for ref in cfg.referenced_models()}
    plan, gates = MoEPlanner(cfg, checkpoints, options, source).build()
    plan.warnings[:0] = cfg.warnings  # what reading the config ignored, first
    return plan, checkpoints, gates


def _refuse_early(out: Path, plan: Plan, overwrite: bool) -> None:
    """The output-directory refusals of execute_plan, checked before the (possibly long) router pass."""
    refuse_non_directory(out)
    if overwrite or not out.is_dir():
        return
    journal = Journal.load(out)
    if journal is not None and journal.fingerprint != plan.fingerprint():
        raise OutputError(f"{out}: holds a merge with a different config or inputs; use --overwrite to replace it")
    if journal is None and foreign_entries(out):
        raise OutputError(f"{out}: directory is not empty; use --overwrite to replace its model files")


def run_moe(
    config: str | Path | MoEConfiguration,
    out_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    controls: RunControls = RunControls(),
    allow_all_same: bool = False,
    on_gate_progress: GateProgress | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> MergeResult:
    """Assemble the MoE model into `out_dir`; rerunning after an interruption resumes where it stopped."""

    def plan_into(options: MergeOptions, out: Path) -> tuple[Plan, dict[str, Any]]:
        plan, checkpoints, gates = build_moe_plan(config, options, out, allow_all_same=allow_all_same)
        _refuse_early(out, plan, controls.overwrite)
        # the planner's warnings (e.g. a router pass over --max-memory) before that pass, its own after
        for warning in plan.warnings:
            if on_warning is not None:
                on_warning(warning)
        router, router_warnings = gates.materialize(on_gate_progress)
        plan.warnings.extend(router_warnings)
        for warning in router_warnings:
            if on_warning is not None:
                on_warning(warning)
        return plan, {**checkpoints, ROUTER_MODEL: router}

    return run_planned(plan_into, out_dir, options, controls)
