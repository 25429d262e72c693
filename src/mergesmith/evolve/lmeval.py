"""Tasks scored by EleutherAI's lm-evaluation-harness (`pip install 'mergesmith[evolve-lm-eval]'`).

Written against lm-eval 0.4.13's task index (`lm_eval.tasks._index`: Entry, Kind), hence the
`lm-eval>=0.4.13` requirement.

A genome task without a `type` is an lm-eval task: a built-in task name or one defined by a YAML under
`--task-search-path`. Everything about it is checked before the first merge, from the harness's own
task index (`TaskManager`, which reads the YAMLs without building datasets or running anything): the
name must be a task or a group, and the genome's `metric` must be one the task reports. lm-eval reports
`METRIC,FILTER` keys (`acc,none`); a genome's `acc` means `acc,none`, as mergekit-evolve's default
`acc,none` does.

Each candidate is scored by one `simple_evaluate` call over all lm-eval tasks, with the harness's
Hugging Face backend (`HFLM`): given the already-built in-memory model object (nothing on disk), or
`pretrained=DIR` for an on-disk candidate. The harness's options (`num_fewshot`, `limit`, batch size
and any other `simple_evaluate` keyword through `--lm-eval-arg KEY=VALUE`) are passed through.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

INSTALL_HINT = "pip install 'mergesmith[evolve-lm-eval]'"


@dataclass(frozen=True)
class LmEvalTask:
    """An lm-eval task with its reported metric key resolved (`acc,none`)."""

    name: str
    metric: str  # the key lm-eval reports, e.g. `acc,none`
    weight: float
    records: tuple[Any, ...]  # the task's YAML config (part of a search's identity)
    kind: str = "lm_eval"
    max_new_tokens: int = 0


def available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


_managers: dict[tuple[str, ...], Any] = {}


def task_manager(search_path: tuple[str, ...], names: tuple[str, ...] = ()) -> Any:
    """One TaskManager per search path per process (indexing lm-eval's ~15k built-in YAMLs takes seconds).

    When every name is defined under the search path, the built-in tasks are not indexed at all: the
    search path overrides them anyway, so the tasks are the same, and indexing is much faster.
    """
    from lm_eval.tasks import TaskManager

    if search_path and names:
        key = (*search_path, "\0only")
        if key not in _managers:
            _managers[key] = TaskManager(include_path=list(search_path), include_defaults=False)
        if all(n in _managers[key].task_index for n in names):
            return _managers[key]
    if search_path not in _managers:
        _managers[search_path] = TaskManager(include_path=list(search_path) or None)
    return _managers[search_path]


def _reported_metrics(entry: Any) -> list[str]:
    """The `METRIC,FILTER` keys a task (or a group's aggregate) reports, read from its YAML config."""
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY
    from lm_eval.tasks._index import Kind

    cfg = dict(entry.cfg or {})
    if entry.kind == Kind.GROUP:
        out = []
        for m in cfg.get("aggregate_metric_list") or []:
            filters = m.get("filter_list", ["none"])
            for f in filters if isinstance(filters, list) else [filters]:
                out.append(f"{m['metric']},{f}")
        return out
    metrics = [m["metric"] for m in cfg.get("metric_list") or [] if isinstance(m, dict) and "metric" in m]
    if not metrics:
        metrics = list(DEFAULT_METRIC_REGISTRY.get(cfg.get("output_type", "generate_until"), []))
    filters = [f["name"] for f in cfg.get("filter_list") or [] if isinstance(f, dict) and "name" in f] or ["none"]
    return [f"{m},{f}" for f in filters for m in metrics]


def resolve_lmeval(task: Any, default_metric: str, search_path: list[str], names: list[str], source: str
                   ) -> LmEvalTask:
    """Check an lm-eval task's name and metric; one ConfigError line naming what is wrong."""
    if not available():
        raise ConfigError(
            f"{source}: task {task.name!r}: not a built-in task (give it `type:` exact_match, multiple_choice or "
            f"loglikelihood and a `data:` file), and lm-evaluation-harness is not installed: {INSTALL_HINT}"
        )
    for path in search_path:
        if not Path(path).is_dir():
            raise ConfigError(f"`--task-search-path`: {path}: not a directory")
    from lm_eval.tasks._index import Kind

    manager = task_manager(tuple(search_path), tuple(names))
    entry = manager.task_index.get(task.name)
    if entry is None:
        where = (f" or under {', '.join(search_path)}" if search_path
                 else " (add its YAML directory with --task-search-path)")
        raise ConfigError(f"{source}: task {task.name!r}: not a built-in task and not an lm-eval task{where}")
    if entry.kind == Kind.TAG:
        raise ConfigError(f"{source}: task {task.name!r}: is an lm-eval tag (a set of tasks with no combined "
                          "metric); name its tasks, or a group")
    reported = _reported_metrics(entry)
    wanted = task.metric or default_metric
    metric = wanted if "," in wanted else f"{wanted.strip()},none"
    metric = ",".join(p.strip() for p in metric.split(","))
    if metric not in reported:
        raise ConfigError(
            f"{source}: task {task.name!r}: metric {wanted!r} is not reported by this lm-eval task "
            f"(it reports {', '.join(reported) or 'no metric'})"
        )
    config = json.loads(json.dumps(entry.cfg or {}, default=str, sort_keys=True))
    return LmEvalTask(task.name, metric, task.weight, (config,))


@dataclass(frozen=True)
class LmEvalSettings:
    """The harness options shared by every candidate (plain data: it travels to Ray tasks)."""

    search_path: tuple[str, ...] = ()
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 32
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    extra: tuple[tuple[str, Any], ...] = ()  # --lm-eval-arg KEY=VALUE

    def fingerprint(self) -> str:
        identity = (self.num_fewshot, self.limit, self.extra, self.apply_chat_template)
        return hashlib.sha256(repr(identity).encode()).hexdigest()


def parse_lm_eval_args(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """`KEY=VALUE` pairs for `simple_evaluate`; a VALUE is read as YAML (numbers, booleans, lists)."""
    import inspect

    import yaml

    known: set[str] = set()
    if available():
        from lm_eval.evaluator import simple_evaluate

        known = set(inspect.signature(simple_evaluate).parameters) - {"model", "model_args", "tasks", "task_manager"}
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"`--lm-eval-arg`: {item!r}: expected KEY=VALUE")
        if known and key not in known:
            raise ConfigError(f"`--lm-eval-arg`: {key!r} is not an argument of lm-eval's simple_evaluate")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            parsed = value
        out.append((key, parsed))
    return tuple(out)


def score_lmeval(tasks: list[LmEvalTask], model: Any, tokenizer: Any, settings: LmEvalSettings,
                 device: str, pretrained_dir: str | None = None) -> dict[str, dict[str, float]]:
    """Every lm-eval task's numeric metrics for one candidate, from one `simple_evaluate` call."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # passing an already-built model is the point here; the harness warns about it on every candidate
    logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
    if pretrained_dir is not None:
        lm = HFLM(pretrained=pretrained_dir, tokenizer=tokenizer, batch_size=settings.batch_size, device=device,
                  dtype="float32" if device == "cpu" else "bfloat16")
    else:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    kwargs: dict[str, Any] = {
        "num_fewshot": settings.num_fewshot,
        "limit": settings.limit,
        "log_samples": False,
        "apply_chat_template": settings.apply_chat_template,
        "fewshot_as_multiturn": settings.fewshot_as_multiturn,
        "bootstrap_iters": 0,
    }
    kwargs.update(dict(settings.extra))
    manager = task_manager(settings.search_path, tuple(t.name for t in tasks))
    try:
        import datasets

        datasets.disable_progress_bars()
    except (ImportError, AttributeError):
        pass
    # the harness's per-request progress bars would scroll over the search's own display
    with contextlib.redirect_stderr(io.StringIO()):
        results = simple_evaluate(model=lm, tasks=[t.name for t in tasks], task_manager=manager, **kwargs)
    if results is None:
        raise ConfigError("lm-eval returned no results (is --lm-eval-arg predict_only set?)")
    table = {**results.get("groups", {}), **results["results"]}  # a group's aggregate may sit in either
    return {
        t.name: {k: float(v) for k, v in table.get(t.name, {}).items()  # metrics only: `METRIC,FILTER` keys
                 if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for t in tasks
    }
