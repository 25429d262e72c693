"""Scoring a candidate: merge it (candidates.py), run every task on it, weigh the metrics.

The same `score_candidate` runs in the driver (local executor) and inside Ray tasks (one candidate per
task, one CPU slot or GPU each), so both executors produce the same scores for the same candidate.
Each process keeps one loader and one tokenizer for the whole search (the in-memory model is reused).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError, MergesmithError
from .candidates import CandidateLoader, CandidateSettings, load_tokenizer
from .evaluators import BuiltinTask, score_builtin


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    models: tuple[str, ...]
    base_model: str | None
    tokenizer_source: str | None


_process_cache: dict[str, Any] = {}


def _loader_and_tokenizer(settings: CandidateSettings, tok: TokenizerSpec) -> tuple[CandidateLoader, Any]:
    key = repr((dataclasses.astuple(settings), tok))
    if _process_cache.get("key") != key:
        _process_cache.clear()
        _process_cache["key"] = key
        _process_cache["loader"] = CandidateLoader(settings)
        _process_cache["tokenizer"] = load_tokenizer(
            list(tok.models), tok.base_model, tok.tokenizer_source, settings.trust_remote_code
        )
    return _process_cache["loader"], _process_cache["tokenizer"]


def fitness(tasks: list[BuiltinTask], scores: dict[str, dict[str, float]]) -> float:
    """The weighted sum the search maximises (mergekit-evolve's objective): sum of weight * metric."""
    return float(sum(t.weight * scores[t.name][t.metric] for t in tasks))


def score_candidate(
    config: dict[str, Any],
    tasks: list[BuiltinTask],
    settings: CandidateSettings,
    tok: TokenizerSpec,
    batch_size: int,
) -> tuple[dict[str, dict[str, float]], float]:
    """Every task's metrics for one merge config, and the seconds it took (merge + load + evaluation)."""
    import torch

    started = time.monotonic()
    threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    loader, tokenizer = _loader_and_tokenizer(settings, tok)
    torch.manual_seed(0)  # nothing here should draw, but a model's init must not depend on history
    try:
        model = loader.load(config)
        try:
            scores = _score_tasks(tasks, model, tokenizer, batch_size, settings, loader)
        finally:
            if not settings.in_memory:
                del model
                loader.cleanup()
    finally:
        torch.set_num_threads(threads)
    return scores, time.monotonic() - started


def _score_tasks(tasks: list[Any], model: Any, tokenizer: Any, batch_size: int, settings: CandidateSettings,
                 loader: CandidateLoader) -> dict[str, dict[str, float]]:
    """Built-in tasks one by one; lm-eval tasks together in one harness call (in memory: the model object;
    on disk: `pretrained=DIR`)."""
    lm_tasks = [t for t in tasks if t.kind == "lm_eval"]
    scores = {t.name: score_builtin(t, model, tokenizer, batch_size) for t in tasks if t.kind != "lm_eval"}
    if lm_tasks:
        from .lmeval import score_lmeval

        pretrained_dir = None if settings.in_memory else str(loader.candidate_dir)
        scores.update(score_lmeval(lm_tasks, model, tokenizer, settings.lm_eval, settings.device, pretrained_dir))
        for t in lm_tasks:
            if t.metric not in scores[t.name]:
                raise MergesmithError(f"task {t.name!r}: lm-eval reported no `{t.metric}` "
                                      f"(it reported {', '.join(scores[t.name]) or 'nothing'})")
    return {t.name: scores[t.name] for t in tasks}


Job = tuple[int, dict[str, Any]]  # (position in the generation, merge config)
Result = tuple[int, dict[str, dict[str, float]], float]


class LocalScorer:
    """Scores a generation's candidates one after the other in this process."""

    def __init__(self, tasks: list[BuiltinTask], settings: CandidateSettings, tok: TokenizerSpec, batch_size: int):
        self.args = (tasks, settings, tok, batch_size)

    def score(self, jobs: list[Job]) -> Iterator[Result]:
        for index, config in jobs:
            scores, seconds = score_candidate(config, *self.args)
            yield index, scores, seconds

    def close(self) -> None:
        return None


def _remote_score(config: dict[str, Any], tasks: list[BuiltinTask], settings: CandidateSettings, tok: TokenizerSpec,
                  batch_size: int, slot: str) -> tuple[dict[str, dict[str, float]], float]:
    """A Ray task: score one candidate (on disk in its own directory, so parallel tasks do not collide)."""
    if settings.in_memory:
        return score_candidate(config, tasks, settings, tok, batch_size)
    slot_dir = os.path.join(settings.storage_path, slot)
    try:
        return score_candidate(config, tasks, dataclasses.replace(settings, storage_path=slot_dir), tok, batch_size)
    finally:
        try:
            os.rmdir(slot_dir)  # empty once its candidate directory is removed
        except OSError:
            pass


class RayScorer:
    """Scores a generation's candidates as Ray tasks, one CPU slot (or one GPU) each; results are
    yielded as they finish and journaled by the driver, exactly as the local scorer's."""

    def __init__(self, tasks: list[BuiltinTask], settings: CandidateSettings, tok: TokenizerSpec, batch_size: int,
                 address: str | None = None, num_cpus: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "`--executor ray` needs Ray, which is not installed: pip install 'mergesmith[ray]'"
            ) from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            import logging

            kwargs: dict[str, Any] = {"address": address, "logging_level": logging.WARNING}
            if address is None and not os.environ.get("RAY_ADDRESS"):
                kwargs["include_dashboard"] = False
                if num_cpus is not None:
                    kwargs["num_cpus"] = num_cpus
            src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(
                p for p in (src, os.environ.get("PYTHONPATH")) if p)}}
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise MergesmithError(f"cannot start or join Ray: {str(exc).splitlines()[0]}") from None
            self.started = True
        gpus = 1 if settings.device.startswith("cuda") else 0
        self.remote = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=2)(_remote_score)
        self.shared = [ray.put(tasks), settings, tok, batch_size]

    def score(self, jobs: list[Job]) -> Iterator[Result]:
        ray = self.ray
        tasks_ref, settings, tok, batch_size = self.shared
        pending = {
            self.remote.remote(config, tasks_ref, settings, tok, batch_size, f"candidate-{index}"): index
            for index, config in jobs
        }
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                index = pending.pop(ref)
                try:
                    scores, seconds = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.as_instanceof_cause()
                    if isinstance(cause, MergesmithError):
                        raise MergesmithError(str(cause).splitlines()[0]) from None
                    raise
                yield index, scores, seconds

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def make_scorer(executor: str, *args: Any, address: str | None = None, num_cpus: int | None = None) -> Any:
    if executor == "ray":
        return RayScorer(*args, address=address, num_cpus=num_cpus)
    return LocalScorer(*args)


ProgressFn = Callable[[str, dict[str, Any]], None]
