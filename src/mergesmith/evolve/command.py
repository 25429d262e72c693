"""`mergesmith evolve`: options to a search, the display, the summary and `--merge-best`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from .display import SearchDisplay
from .search import SearchOptions, run_search


def search_options(kw: dict[str, Any]) -> SearchOptions:
    from ..runtime.devices import resolve_device

    device = resolve_device(kw.get("device", "cpu"), check=kw.get("executor") != "ray", what="--device")
    merge_device = "cuda" if kw.get("merge_cuda") else "cpu"
    if merge_device == "cuda":
        resolve_device("cuda", check=kw.get("executor") != "ray", what="--merge-cuda")
    return SearchOptions(
        max_fevals=kw["max_fevals"],
        sigma0=kw["sigma0"],
        random_seed=kw["random_seed"],
        popsize=kw.get("popsize"),
        batch_size=kw["batch_size"],
        dtype=_dtype(kw["dtype"]),
        in_memory=kw.get("in_memory"),
        device=device,
        merge_device=merge_device,
        executor=kw["executor"],
        ray_address=kw.get("ray_address"),
        overwrite=kw["overwrite"],
        trust_remote_code=kw["trust_remote_code"],
        allow_crimes=kw["allow_crimes"],
        task_search_path=list(kw.get("task_search_path") or ()),
        limit=kw.get("limit"),
        num_fewshot=kw.get("num_fewshot"),
        threads=kw.get("threads"),
        lm_eval_args=list(kw.get("lm_eval_arg") or ()),
        timeout=kw.get("timeout"),
    )


def _dtype(name: str) -> str:
    from ..config import known_dtype_name

    try:
        return known_dtype_name(name) or "bfloat16"
    except ValueError as exc:
        raise ConfigError(f"`--dtype`: {exc}") from None


def run_evolve_command(genome_file: Path, storage_path: Path, kw: dict[str, Any]) -> None:
    options = search_options(kw)
    merge_best: Path | None = kw.get("merge_best")
    display = SearchDisplay(quiet=kw["quiet"])
    try:
        result = run_search(genome_file, storage_path, options, display)
    finally:
        display.close()
    best = result.best
    scores = ", ".join(f"{t}: {', '.join(f'{m} {v:.4f}' for m, v in ms.items())}" for t, ms in best["scores"].items())
    click.echo(
        f"best fitness {best['fitness']:.4f} at evaluation {best['evaluation']} of {len(result.history)} "
        f"({scores}); {result.seconds:.1f} s"
    )
    click.echo(f"wrote {result.storage / 'best_config.yml'}, history.jsonl, summary.json, search.png")
    if merge_best is not None:
        from ..config import parse_config
        from ..engine.planning.shared import MergeOptions
        from ..engine.run import RunControls, run_merge

        cfg = parse_config(best["config"], str(result.storage / "best_config.yml"))

        def warn(plan: Any) -> None:
            for warning in plan.warnings:
                click.echo(f"warning: {warning}", err=True)

        controls = RunControls(overwrite=kw["overwrite"], on_plan=warn)
        # the best merge is merged where the candidates were (--merge-cuda), so it is the model that was scored
        merge = MergeOptions(random_seed=options.random_seed, device=options.merge_device)
        merged = run_merge(cfg, merge_best, merge, controls=controls)
        for warning in merged.warnings:  # found while merging: NaN/inf
            click.echo(f"warning: {warning}", err=True)
        click.echo(f"wrote the best merge to {merged.out_dir}")
