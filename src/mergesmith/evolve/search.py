"""The search loop: CMA-ES (the `cma` package) over a genome, scored by built-in or lm-eval tasks, journaled.

Determinism: the optimiser draws its samples from its own seeded numpy Generator (cma's `randn`
option), which is pickled with it after every generation; nothing else in the process can move it.
So asking a reloaded optimiser for its generation again gives the same candidates, and a killed
search, rerun, scores only those its history lacks: the history equals an uninterrupted run's.
Parallel scoring (Ray) returns candidates in any order; the optimiser is told in generation order.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, MergeInterrupted
from .candidates import MEMORY_FRACTION, SMALL_MODEL_BYTES, CandidateLoader, CandidateSettings, eval_dtype
from .config import LMEVAL_DEFAULT_METRIC, EvolveConfiguration, load_evolve_config
from .evaluators import LOWER_IS_BETTER, BuiltinTask, resolve_builtin
from .genome import Genome
from .journal import SearchJournal
from .lmeval import LmEvalSettings, LmEvalTask, parse_lm_eval_args, resolve_lmeval
from .scoring import ProgressFn, TokenizerSpec, fitness, make_scorer


class SeededNormal:
    """cma's `randn` option: standard normal draws from a private, picklable numpy Generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape)


@dataclass
class SearchOptions:
    max_fevals: int = 100
    sigma0: float = 1 / 6
    random_seed: int = 0
    popsize: int | None = None
    batch_size: int = 32
    dtype: str = "bfloat16"
    in_memory: bool | None = None  # None: in memory when it fits
    device: str = "cpu"
    merge_device: str = "cpu"
    executor: str = "local"
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    overwrite: bool = False
    trust_remote_code: bool = False
    allow_crimes: bool = False
    task_search_path: list[str] = field(default_factory=list)
    limit: int | None = None  # overrides the config's `limit`
    num_fewshot: int | None = None  # overrides the config's `num_fewshot`
    threads: int | None = None  # torch threads while scoring (None: 1 for small models, else torch's default)
    lm_eval_args: list[str] = field(default_factory=list)  # KEY=VALUE for lm-eval's simple_evaluate
    # mergekit-evolve's --timeout: no generation starts once this many seconds have passed (one in progress is
    # finished and journaled, so a rerun resumes there)
    timeout: float | None = None


@dataclass
class SearchResult:
    storage: Path
    history: list[dict[str, Any]]
    best: dict[str, Any]
    seconds: float
    resumed: bool
    estimate: dict[str, Any]


Task = BuiltinTask | LmEvalTask


def _timed_out(options: SearchOptions, started: float) -> bool:
    """Whether --timeout seconds have passed since the search started (checked between generations, as CMA-ES's
    own `timeout` stop that mergekit-evolve sets; the first generation always runs, so there is a best)."""
    return options.timeout is not None and time.monotonic() - started >= options.timeout


def resolve_tasks(config: EvolveConfiguration, source: str, options: SearchOptions) -> list[Task]:
    """Every task checked before the first merge: its kind, its metric, its data file (or lm-eval task)."""
    names = [t.name for t in config.tasks]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"{source}: `tasks`: task {dup!r} is listed twice")
    out: list[Task] = []
    lm_names = [t.name for t in config.tasks if not t.builtin]
    for task in config.tasks:
        if not task.builtin:
            out.append(resolve_lmeval(task, LMEVAL_DEFAULT_METRIC, options.task_search_path, lm_names, source))
            continue
        resolved = resolve_builtin(task, config.limit, source)
        out.append(resolved)
    return out


def lower_is_better_warnings(tasks: list[Task]) -> list[str]:
    return [
        f"task {t.name!r}: `{t.metric}` is lower-is-better but its weight {t.weight} is positive; the search will "
        "maximise it (give it a negative weight, as in mergekit-evolve)"
        for t in tasks
        if t.metric.split(",")[0] in (*LOWER_IS_BETTER, "word_perplexity", "byte_perplexity", "bits_per_byte")
        and t.weight > 0
    ]


def _fingerprint(config: EvolveConfiguration, tasks: list[Task], options: SearchOptions, genome: Genome,
                 lm_eval: LmEvalSettings | None = None) -> str:
    payload = {
        "genome": config.genome.model_dump(),
        "tasks": [
            {"name": t.name, "kind": t.kind, "metric": t.metric, "weight": t.weight, "max_new_tokens": t.max_new_tokens,
             "records": hashlib.sha256(json.dumps(t.records, sort_keys=True).encode()).hexdigest()}
            for t in tasks
        ],
        "random_init": config.random_init,
        "seed": options.random_seed,
        "sigma0": options.sigma0,
        "popsize": options.popsize,
        "dtype": options.dtype,
        "batch_size": options.batch_size,
        "dimension": genome.dimension,
    }
    if lm_eval is not None:  # only lm-eval searches carry it, so built-in searches keep their identity
        payload["lm_eval"] = lm_eval.fingerprint()
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def new_optimizer(x0: np.ndarray, options: SearchOptions) -> Any:
    try:
        import cma
    except ImportError:
        raise ConfigError("`mergesmith evolve` needs the `cma` package: pip install 'mergesmith[evolve]'") from None

    opts: dict[str, Any] = {"seed": float("nan"), "randn": SeededNormal(options.random_seed), "verbose": -9,
                            "verb_log": 0, "verb_disp": 0}
    if options.popsize:
        opts["popsize"] = options.popsize
    return cma.CMAEvolutionStrategy(list(map(float, x0)), options.sigma0, opts)


def estimate(genome: Genome, loader: CandidateLoader, x0: np.ndarray, options: SearchOptions) -> dict[str, Any]:
    """Per-candidate cost from the first candidate's plan (headers only), and the memory/disk choice."""
    import psutil

    from ..engine.report import probe_read_throughput

    plan = loader.plan(genome.merge_config(x0))
    est = plan.estimate
    assert est is not None
    merged = plan.total_size
    import torch

    eval_size = torch.empty((), dtype=eval_dtype(options.device)).element_size()
    elements = sum(r.numel() for r in plan.recipes)
    model_bytes = elements * eval_size
    memory_needed = merged + model_bytes + est.peak_memory
    available = psutil.virtual_memory().available
    fits = memory_needed <= available * MEMORY_FRACTION
    in_memory = fits if options.in_memory is None else options.in_memory
    rate = probe_read_throughput(loader.checkpoints)
    seconds = est.bytes_read / rate if rate > 0 else 0.0
    if not in_memory:
        seconds += 2 * merged / rate if rate > 0 else 0.0  # written, then read back by from_pretrained
    return {
        "parameters": genome.dimension,
        "shape": list(genome.shape),
        "in_memory": in_memory,
        "fits_in_memory": fits,
        "bytes_read": est.bytes_read,
        "merged_bytes": merged,
        "memory_bytes": memory_needed if in_memory else model_bytes + est.peak_memory,
        "disk_bytes": 0 if in_memory else merged,
        "merge_seconds": seconds,
        "available_memory": available,
    }


def run_search(config_path: str | Path, storage_path: str | Path, options: SearchOptions,
               progress: ProgressFn | None = None) -> SearchResult:
    started = time.monotonic()
    emit = progress or (lambda _kind, _data: None)
    source = str(config_path)
    config, _raw = load_evolve_config(config_path)
    overrides = {k: getattr(options, k) for k in ("limit", "num_fewshot") if getattr(options, k) is not None}
    if overrides:
        config = config.model_copy(update=overrides)
    genome = Genome.build(config.genome, source, options.dtype)
    lm_eval_extra = parse_lm_eval_args(options.lm_eval_args)
    tasks = resolve_tasks(config, source, options)
    has_lm_eval = any(isinstance(t, LmEvalTask) for t in tasks)
    for warning in lower_is_better_warnings(tasks):
        emit("warning", {"text": warning})
    if not has_lm_eval:
        for what, given in (("`num_fewshot`", config.num_fewshot), ("`--task-search-path`", options.task_search_path),
                            ("`--lm-eval-arg`", options.lm_eval_args)):
            if given:
                emit("warning", {"text": f"{what} applies to lm-eval tasks only; the built-in tasks ignore it"})
    storage = Path(storage_path)
    x0 = genome.initial(random=config.random_init, rng=np.random.default_rng(options.random_seed))
    settings = CandidateSettings(
        storage_path=str(storage.resolve()), in_memory=True, device=options.device,
        merge_device=options.merge_device, trust_remote_code=options.trust_remote_code,
        allow_crimes=options.allow_crimes, random_seed=options.random_seed,
    )
    probe = CandidateLoader(settings)
    cost = estimate(genome, probe, x0, options)  # plans the first candidate: a bad merge fails here, before any
    settings.in_memory = cost["in_memory"]
    settings.threads = options.threads or (1 if cost["merged_bytes"] < SMALL_MODEL_BYTES else None)
    tok = TokenizerSpec(tuple(config.genome.models), config.genome.base_model, config.genome.tokenizer_source)
    from .candidates import load_tokenizer

    tokenizer = load_tokenizer(list(tok.models), tok.base_model, tok.tokenizer_source, options.trust_remote_code)
    lm_eval = None
    if has_lm_eval:
        # mergekit-evolve's apply_chat_template default is true; a tokenizer without a template cannot apply one
        chat = bool(config.apply_chat_template and getattr(tokenizer, "chat_template", None))
        lm_eval = LmEvalSettings(
            search_path=tuple(str(Path(p).resolve()) for p in options.task_search_path),
            num_fewshot=config.num_fewshot, limit=config.limit, batch_size=options.batch_size,
            apply_chat_template=chat, fewshot_as_multiturn=bool(chat and config.fewshot_as_multiturn),
            extra=lm_eval_extra,
        )
        settings.lm_eval = lm_eval
    emit("estimate", cost)

    journal = SearchJournal(storage)
    fingerprint = _fingerprint(config, tasks, options, genome, lm_eval)
    describe = {"genome": str(config_path), "seed": options.random_seed, "dimension": genome.dimension,
                "names": genome.names()}
    resumed = journal.prepare(fingerprint, describe, options.overwrite)
    history = journal.history() if resumed else []
    es = journal.load_optimizer() if resumed else None
    if es is None:
        es = new_optimizer(x0, options)
    popsize = es.popsize
    best = max(history, key=lambda r: (r["fitness"], -r["evaluation"])) if history else None
    if best is not None:
        journal.save_best(best["config"])
    emit("start", {"resumed": resumed, "done": len(history), "popsize": popsize, "max_fevals": options.max_fevals,
                   "best": best})
    scorer = make_scorer(options.executor, tasks, settings, tok, options.batch_size,
                         address=options.ray_address, num_cpus=options.ray_num_cpus)
    try:
        # only the evaluation budget ends a search: accuracies are discrete, so CMA-ES's flat-fitness and
        # tolerance stops would end it early on a plateau (mergekit-evolve users set --max-fevals)
        while es.countevals < options.max_fevals and not (best is not None and _timed_out(options, started)):
            generation = es.countiter + 1
            candidates = es.ask()
            rows: dict[int, dict[str, Any]] = {}
            for row in history:
                if row["generation"] != generation:
                    continue
                if not np.array_equal(np.asarray(row["params"]), np.asarray(candidates[row["index"]])):
                    raise ConfigError(
                        f"{storage}: the journal's generation {generation} does not match the optimiser's; "
                        "use --overwrite to start over"
                    )
                rows[row["index"]] = row
            configs = {i: genome.merge_config(x) for i, x in enumerate(candidates)}
            jobs = [(i, configs[i]) for i in range(len(candidates)) if i not in rows]
            for index, scores, seconds in scorer.score(jobs):
                row = {
                    "evaluation": (generation - 1) * popsize + index + 1,
                    "generation": generation,
                    "index": index,
                    "params": [float(v) for v in candidates[index]],
                    "named_params": dict(zip(genome.names(), _rounded(genome.values(candidates[index])), strict=False)),
                    "config": configs[index],
                    "scores": scores,
                    "fitness": fitness(tasks, scores),
                    "seconds": round(seconds, 3),
                }
                journal.append(row)
                rows[index] = row
                history.append(row)
                if best is None or (row["fitness"], -row["evaluation"]) > (best["fitness"], -best["evaluation"]):
                    best = row
                    journal.save_best(row["config"])
                emit("candidate", {"row": row, "best": best, "done": len(history)})
            es.tell(candidates, [-rows[i]["fitness"] for i in range(len(candidates))])
            journal.save_optimizer(es)
    except KeyboardInterrupt:
        raise MergeInterrupted(
            f"interrupted: {len(history)} candidates are journaled in {storage}; run the same command again to resume"
        ) from None
    finally:
        scorer.close()
    history.sort(key=lambda r: r["evaluation"])
    journal.rewrite_history(history)
    assert best is not None
    seconds = time.monotonic() - started
    summary = {
        "evaluations": len(history),
        "generations": es.countiter,
        "best": {k: best[k] for k in ("evaluation", "generation", "fitness", "scores", "named_params")},
        "best_config": "best_config.yml",
        "seconds": round(seconds, 2),
        "estimate": cost,
        "options": {k: v for k, v in asdict(options).items() if k not in ("overwrite",)},
    }
    journal.save_summary(summary)
    from .plot import plot_search

    plot_search(history, storage / "search.png")
    return SearchResult(storage, history, best, seconds, resumed, cost)


def _rounded(values: dict[str, np.ndarray]) -> list[float]:
    """The transformed parameter values in genome order (group, model, set, parameter)."""
    stacked = np.stack([values[k] for k in values], axis=-1)
    return [round(float(v), 6) if math.isfinite(float(v)) else float(v) for v in stacked.reshape(-1)]
