"""What a command that writes a model shows around its run: the plan's warnings, the progress display (none
with -q) under Ctrl-C handling, and the closing lines (warnings found while merging, a resume, what was
written where).

Why apart from cli.py: these are displays, shared by every command that writes a model; the command line
only picks which to use, and nothing below the face imports the command line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..runtime.process_tuning import freeze_long_lived_objects
from ..sizes import human_size
from .interrupts import Interrupts


def merge_progress(quiet: bool) -> Any:
    """The live bar on a terminal, plain periodic lines elsewhere, nothing with -q (display/terminal.py)."""
    from .terminal import merge_progress as chosen

    return chosen(quiet)


def warn_then(start: Any, prefix: str = "") -> Any:
    """An `on_plan` callback that prints the plan's warnings on stderr (with -q too: it hides progress only),
    then calls `start`."""

    def on_plan(plan: Any) -> None:
        freeze_long_lived_objects()  # the plan is built: what is alive now lives until the end
        for warning in plan.warnings:
            click.echo(f"{prefix}warning: {warning}", err=True)
        start(plan)

    return on_plan


def run_shown(run: Callable[..., Any], quiet: bool, *args: Any, **kwargs: Any) -> Any:
    """`run(*args, controls=..., **kwargs)` under the progress display (none with -q) and Ctrl-C handling every
    command that writes a model uses: the plan's warnings first, then the bar; an interrupt stops at a
    resumable point. `kwargs` may hold `controls` (a RunControls with overwrite/force/verify): the display's
    callbacks and the stop event are filled in."""
    from dataclasses import replace

    from ..engine.run import RunControls

    controls = kwargs.pop("controls", None) or RunControls()
    with Interrupts() as interrupts, merge_progress(quiet) as progress:
        shown = replace(controls, on_plan=warn_then(progress.start), on_progress=progress.update, stop=interrupts.stop)
        return run(*args, controls=shown, **kwargs)


def print_merge_warnings(result: Any, prefix: str = "") -> None:
    """What the merge found while running (NaN/inf in inputs or output), as the plan's warnings are printed
    (with -q too)."""
    for warning in getattr(result, "warnings", ()):
        click.echo(f"{prefix}warning: {warning}", err=True)


def report_resume(result: Any, prefix: str = "") -> None:
    """`resumed: 8 of 75 tensors already written (...)` when the run continued an earlier one, before the
    line saying what was written: whole shards and tensors journaled inside a shard alike, so no resume
    goes unreported."""
    line = result.resume_line()
    if line is not None:
        click.echo(f"{prefix}{line}")


def report_result(out_dir: Path, result: Any, prefix: str = "") -> None:
    """What the merge found while running, then what it resumed, where it wrote and what."""
    print_merge_warnings(result, prefix)
    plan = result.plan
    if result.already_complete:
        click.echo(f"{prefix}{out_dir}: already complete (same config and inputs); nothing to do")
        return
    report_resume(result, prefix)
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    click.echo(
        f"{prefix}wrote {out_dir} ({len(plan.recipes)} tensors in {len(plan.shards)} shard(s), "
        f"{human_size(plan.total_size)}) in {result.seconds:.1f}s{seed}"
    )
