"""Which merge method keeps the most skills? Every task-vector method on four tiny fine-tunes, one per skill.

    python bench/skills_table.py                                   # every method of TABLE, markdown on stdout
    python bench/skills_table.py --methods task_arithmetic,ties    # some of them
    python bench/skills_table.py --limit 30 --seeds 1              # quicker: 30 prompts per skill, one seed

The models are tests/fixtures/skills4 (examples/evolve_skills/make_fixtures.py --skills4): a char-level llama
(4 layers, hidden 32, 42 k parameters, bfloat16) trained on a mix of four skills and stopped half way, and four
60-step fine-tunes of it, one per skill (`add`, `rev`, `sort`, `next`), each a small delta from the base. Each
row merges the four fine-tunes onto the base with one method, as a user would (`mergesmith.merge` on a
mergekit-shaped config, computed in float32, written in bfloat16), loads the result with transformers and
scores it with mergesmith's built-in `exact_match` evaluator (greedy generation, batched) on each skill's 150
held-out prompts.

Hyperparameters: TABLE below, one row per method, with where each value comes from. Most papers tune their
scale on validation data; where they do, the row takes the value the paper (or its authors' code) names as its
default, or the one later papers fix for it. A convention for the scale: methods that SUM the task vectors
(task arithmetic and its sparsified variants without sign election) use task arithmetic's lambda = 0.3;
methods that AVERAGE over the agreeing models (TIES' disjoint mean: `normalize: true`) use lambda = 1, as TIES
recommends. Randomised methods (DARE, DELLA) are merged with `--seeds` seeds (0, 1, ...) and the mean is shown.

A method that is not registered in this checkout prints as "not available" (the table can be rerun after
more methods are merged in); a merge that fails prints its error in the row instead of stopping the table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "skills4"
SKILLS = ("add", "rev", "sort", "next")


@dataclass(frozen=True)
class Row:
    method: str
    params: dict[str, Any] = field(default_factory=dict)  # merge-wide `parameters:`
    model_params: dict[str, Any] = field(default_factory=dict)  # each fine-tune's `parameters:`
    source: str = ""
    with_base: bool = True  # a task-vector method: base_model is the base; False: the fine-tunes alone


TA_LAMBDA = 0.3
TABLE: tuple[Row, ...] = (
    Row("task_arithmetic", {"lambda": TA_LAMBDA, "normalize": False}, {"weight": 1.0},
        "Ilharco et al. 2023 tune lambda on validation; 0.3 is the value TIES, TALL masks and TSV fix for it"),
    Row("ties", {"lambda": 1.0, "normalize": True}, {"weight": 1.0, "density": 0.2},
        "Yadav et al. 2023: keep the top 20 %, lambda = 1 where no validation set is at hand"),
    Row("dare_linear", {"lambda": TA_LAMBDA, "normalize": False, "rescale": True}, {"weight": 1.0, "density": 0.1},
        "Yu et al. 2024: drop rate p = 0.9 with rescaling, then task arithmetic (its lambda)"),
    Row("dare_ties", {"lambda": 1.0, "normalize": True, "rescale": True}, {"weight": 1.0, "density": 0.1},
        "Yu et al. 2024: p = 0.9 with rescaling, then TIES' sign election and disjoint mean (lambda = 1)"),
    Row("della", {"lambda": 1.0, "normalize": True}, {"weight": 1.0, "density": 0.3, "epsilon": 0.1},
        "Deep et al. 2024: MagPrune drop p = 0.7, epsilon = 0.1 from the paper's grid; elect and fuse, lambda = 1"),
    Row("della_linear", {"lambda": TA_LAMBDA, "normalize": False}, {"weight": 1.0, "density": 0.3, "epsilon": 0.1},
        "Deep et al. 2024's MagPrune (as della) without the election, summed with task arithmetic's lambda"),
    Row("breadcrumbs", {"lambda": TA_LAMBDA, "normalize": False}, {"weight": 1.0, "density": 0.9, "gamma": 0.01},
        "Davari & Belilovsky 2023: drop the largest 1 % and the smallest magnitudes (keep 90 %; mergekit's "
        "documented values), then task arithmetic's lambda"),
    Row("breadcrumbs_ties", {"lambda": 1.0, "normalize": True}, {"weight": 1.0, "density": 0.9, "gamma": 0.01},
        "as breadcrumbs, with TIES' sign election and disjoint mean (lambda = 1)"),
    Row("sce", {"select_topk": 0.1}, {},
        "Wan et al. 2024 (FuseChat), SCE: select the top 10 % variance positions; coefficients from the vectors"),
    Row("tsv", {"alpha": 1.0}, {"weight": 1.0},
        "Gargiulo et al. 2025 (TSV-M): alpha = 1, each task's top 1/T singular directions"),
    Row("iso_c", {"scaling_factor": 1.0}, {"weight": 1.0},
        "Marczak et al. 2025: alpha tuned on validation; 1.0, the method's default"),
    Row("iso_cts", {"scaling_factor": 1.0, "common_space_fraction": 0.8}, {"weight": 1.0},
        "Marczak et al. 2025: common subspace fraction k = 0.8 (the paper's choice), alpha 1.0"),
    Row("consensus_ta", {"normalize": False}, {"weight": TA_LAMBDA, "k": 2, "lambda": 0.4},
        "Wang et al. 2024 (TALL masks): k = 2, mask lambda 0.4 (middle of the paper's 0.2-0.6); task "
        "arithmetic's 0.3 as the weight"),
    Row("consensus_ties", {"normalize": True}, {"weight": 1.0, "density": 0.2, "k": 2, "lambda": 0.4},
        "Wang et al. 2024: k = 2, mask lambda 0.4, on TIES at its own defaults (top 20 %, disjoint mean)"),
    Row("pcb", {"pcb_ratio": 0.1}, {"weight": 1.0},
        "Du et al. 2024: keep ratio 0.1 (the authors' code's default), lambda_i = 1"),
    Row("magmax", {"scaling_factor": 0.5}, {},
        "Marczak et al. 2024: scaling 0.5 (the authors' 8-task script)"),
    Row("wudi", {}, {},
        "Cheng et al. 2025: the method's defaults (the paper's optimiser settings)"),
    Row("lines", {"beta": 0.5}, {"weight": 1.0},
        "Wang et al. 2025 (LiNeS): alpha = 1/T (the paper's multi-task rule), beta 0.5 (middle of its grid)"),
    Row("regmean", {"reduce_non_diagonal_ratio": 0.6, "calibration": "{fixtures}/calibration.txt"}, {},
        "Jin et al. 2023: off-diagonal ratio 0.6 (FusionBench's configs); Grams on the skills' training "
        "examples (calibration.txt, 64 per skill)", with_base=False),
)


def config_for(row: Row, fixtures: Path) -> dict[str, Any]:
    """The mergekit-shaped config a user would write for `row`."""
    params = {k: (v.format(fixtures=fixtures) if isinstance(v, str) else v) for k, v in row.params.items()}
    models = [{"model": str(fixtures / s), **({"parameters": dict(row.model_params)} if row.model_params else {})}
              for s in SKILLS]
    # computed in float32, as the papers do (RegMean warns on a lower compute dtype), written in the fixtures' bf16
    config: dict[str, Any] = {"merge_method": row.method, "models": models, "dtype": "float32",
                              "out_dtype": "bfloat16"}
    if row.with_base:
        config["base_model"] = str(fixtures / "base")
    if params:
        config["parameters"] = params
    return config


class Scorer:
    """Loads a model folder with transformers and scores every skill with the built-in exact_match evaluator."""

    def __init__(self, fixtures: Path, limit: int | None, batch_size: int) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from mergesmith.evolve.config import TaskDefinition
        from mergesmith.evolve.evaluators import resolve_builtin

        self.tasks = [
            resolve_builtin(TaskDefinition(name=s, type="exact_match", data=str(fixtures / f"{s}_eval.jsonl")),
                            limit, "skills_table")
            for s in SKILLS
        ]
        hf_logging.disable_progress_bar()  # one "Loading weights" bar per model would bury the table
        self.tokenizer = AutoTokenizer.from_pretrained(fixtures / "base")
        self.batch_size = batch_size

    def __call__(self, folder: Path) -> dict[str, float]:
        import torch
        from transformers import AutoModelForCausalLM

        from mergesmith.evolve.evaluators import score_builtin

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return {t.name: score_builtin(t, model, self.tokenizer, self.batch_size)["acc"] for t in self.tasks}


def merge_and_score(row: Row, fixtures: Path, scorer: Scorer, work: Path, seeds: int) -> tuple[dict[str, float],
                                                                                                  int]:
    """Mean accuracy per skill over the seeds (one merge unless the method is randomised), and the merge count."""
    import mergesmith
    from mergesmith.methods import get_method

    spec = get_method(row.method)
    runs = range(seeds) if spec is not None and spec.randomized else range(1)
    totals = dict.fromkeys(SKILLS, 0.0)
    for seed in runs:
        out = work / f"{row.method}-{seed}"
        # strict: a parameter name the method does not take is an error, not a silently ignored default
        mergesmith.merge(config_for(row, fixtures), out, random_seed=seed, threads=1, overwrite=True, strict=True)
        for skill, acc in scorer(out).items():
            totals[skill] += acc / len(runs)
        shutil.rmtree(out, ignore_errors=True)
    return totals, len(runs)


def _fmt_params(row: Row) -> str:
    parts = [f"{k}={v}" for k, v in row.params.items() if k != "calibration"]
    parts += [f"{k}={v}" for k, v in row.model_params.items()]
    if "calibration" in row.params:
        parts.append("calibration=calibration.txt")
    return ", ".join(parts) or "defaults"


def _line(name: str, params: str, accs: dict[str, float] | None, note: str = "") -> str:
    if accs is None:
        return f"| {name} | {params} | " + " | ".join("" for _ in SKILLS) + f" | {note} |"
    mean = sum(accs.values()) / len(accs)
    return f"| {name} | {params} | " + " | ".join(f"{accs[s]:.3f}" for s in SKILLS) + f" | **{mean:.3f}** |"


def run(methods: list[str] | None, fixtures: Path, limit: int | None, seeds: int, batch_size: int,
        show_sources: bool = True) -> list[str]:
    """The table's lines (printed as they come); `methods` None: every row of TABLE."""
    import torch

    from mergesmith.methods import get_method

    torch.set_num_threads(2)
    rows = [r for r in TABLE if methods is None or r.method in methods]
    unknown = sorted(set(methods or ()) - {r.method for r in TABLE})
    if unknown:
        raise SystemExit(f"error: not in the table: {', '.join(unknown)} (it has {', '.join(r.method for r in TABLE)})")
    scorer = Scorer(fixtures, limit, batch_size)
    lines = ["| model | hyperparameters | " + " | ".join(SKILLS) + " | mean |",
             "|---|---|" + "---|" * len(SKILLS) + "---|"]
    for line in lines:
        print(line, flush=True)

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.monotonic()
    for name in ("base", *SKILLS):
        emit(_line(name if name == "base" else f"{name} fine-tune alone", "", scorer(fixtures / name)))
    with tempfile.TemporaryDirectory(prefix="skills-table-") as tmp:
        for row in rows:
            if get_method(row.method) is None:
                emit(_line(row.method, _fmt_params(row), None, "not available"))
                continue
            try:
                accs, runs = merge_and_score(row, fixtures, scorer, Path(tmp), seeds)
            except Exception as exc:  # one failing method must not stop the table
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                emit(_line(row.method, _fmt_params(row), None, f"error: {first}"))
                continue
            label = row.method + (f" (mean of {runs} seeds)" if runs > 1 else "")
            emit(_line(label, _fmt_params(row), accs))
    print(f"\n{len(rows)} methods, {time.monotonic() - started:.0f} s; prompts per skill: "
          f"{len(scorer.tasks[0].records)}", file=sys.stderr)
    if show_sources:
        print("\nWhere the hyperparameters come from:", file=sys.stderr)
        for row in rows:
            print(f"- {row.method}: {row.source}", file=sys.stderr)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", help="comma-separated methods of the table (default: all)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES, help="the four-skill fixture folder")
    parser.add_argument("--limit", type=int, help="score only the first N held-out prompts per skill")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per randomised method (default 3)")
    parser.add_argument("--batch-size", type=int, default=150, help="prompts per generate() call")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    run(methods, args.fixtures.resolve(), args.limit, args.seeds, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
