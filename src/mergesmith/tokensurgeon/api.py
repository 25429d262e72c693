"""Run a tokenizer transplant: plan from headers and tokenizers, then write through `engine.run.execute_plan`.

Writing goes through the output protocol every planner shares, so a transplant resumes after an
interruption, checks the disk and reports progress like a merge.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.plan import Plan
from ..engine.planning.shared import MergeOptions
from ..engine.run import MergeResult, RunControls, reuse_or_draw_seed, run_planned
from ..io.checkpoint import Checkpoint
from ..io.journal import refuse_non_directory
from .planner import SurgeryOptions, TokenSurgeonPlanner


def build_tokensurgeon_plan(
    base: str | Path,
    donor: str | Path,
    surgery: SurgeryOptions | None = None,
    options: MergeOptions | None = None,
    out_dir: str | Path | None = None,
) -> tuple[Plan, dict[str, Checkpoint], dict[str, dict[str, int]]]:
    """Plan the transplant (reads headers and tokenizers, no tensor). Returns the plan, the opened
    checkpoints and per-tensor counts of exact/byte/prefix matches and approximated tokens.

    For `randn` or `new_vocab_noise` without a seed, reuse the seed an interrupted run in `out_dir`
    recorded (so it resumes), or draw a new one."""
    surgery = surgery or SurgeryOptions()
    options = options or MergeOptions()
    surgery.check()
    if surgery.needs_seed:
        reuse_or_draw_seed(options, out_dir)
    base_ref, donor_ref = str(base), str(donor)
    base_ck = options.open_input(base_ref)
    donor_ck = base_ck if donor_ref == base_ref else options.open_input(donor_ref)
    planner = TokenSurgeonPlanner(base_ck, donor_ck, options, surgery, base_ref, donor_ref)
    plan, counts = planner.build()
    return plan, {base_ref: base_ck, donor_ref: donor_ck}, counts


def run_tokensurgeon(
    base: str | Path,
    donor: str | Path,
    out_dir: str | Path,
    surgery: SurgeryOptions | None = None,
    options: MergeOptions | None = None,
    *,
    controls: RunControls = RunControls(),
) -> tuple[MergeResult, dict[str, dict[str, int]]]:
    """Write BASE with DONOR's tokenizer into `out_dir`; rerunning after an interruption resumes."""
    counts: dict[str, dict[str, int]] = {}

    def plan_into(options: MergeOptions, out: Path) -> tuple[Plan, dict[str, Checkpoint]]:
        refuse_non_directory(out)
        plan, checkpoints, found = build_tokensurgeon_plan(base, donor, surgery, options, out)
        counts.update(found)
        return plan, checkpoints

    result = run_planned(plan_into, out_dir, options, controls)
    return result, counts
