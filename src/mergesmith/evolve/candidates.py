"""Candidate merges, made by mergesmith's own planner and executor, loaded straight into a model.

Two ways, chosen per search:
- in memory: the plan's recipes are computed one by one (the executor's `compute`, the same code
  that feeds the writer) into a state dict that is loaded into one reused transformers model. Nothing
  touches the disk. This is a small collecting sink over the engine; a general `merge_state_dicts`
  API (being built elsewhere) can replace `merge_in_memory` when it lands.
- on disk: the merge is written with the ordinary journaled protocol into ONE reused directory under
  the storage path, loaded with `from_pretrained`, and the directory is removed after scoring, so the
  disk holds at most one candidate whatever the number of candidates.
Both paths run the same recipes with the same dtypes, so they load bit-identical weights (see
tests/test_evolve.py::test_memory_and_disk_paths_score_equally).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import parse_config
from ..engine.execution.compute import compute
from ..engine.plan import Plan
from ..engine.planning.merge_planner import Planner
from ..engine.planning.shared import MergeOptions
from ..errors import ConfigError
from ..io.checkpoint import Checkpoint
from ..io.dtypes import to_torch
from ..io.references import open_checkpoint

CANDIDATE_DIR = "candidate"
SMALL_MODEL_BYTES = 64 << 20
"""Below this merged size a candidate is scored on one torch thread: a tiny model's matrix products are
microseconds, and waking a thread pool costs more than that (measured 33 us vs 5.6 ms for a 96x48 linear
on 2 busy cores: `torch.set_num_threads`)."""
MEMORY_FRACTION = 0.6
"""In-memory merging is chosen when the merged weights, the evaluation model and the merge's working
memory together fit in this fraction of the memory available at start."""


@dataclass
class CandidateSettings:
    """Everything a worker needs to merge and load candidates (plain data: it travels to Ray tasks)."""

    storage_path: str
    in_memory: bool
    device: str = "cpu"
    merge_device: str = "cpu"
    trust_remote_code: bool = False
    allow_crimes: bool = False
    random_seed: int | None = None
    threads: int | None = None  # torch threads while scoring (None: torch's default)
    lm_eval: Any = None  # lmeval.LmEvalSettings when the genome names lm-eval tasks


def plan_candidate(
    config: dict[str, Any], checkpoints: dict[str, Checkpoint], settings: CandidateSettings, source: str = "candidate"
) -> Plan:
    cfg = parse_config(config, source)
    missing = [ref for ref in cfg.referenced_models() if ref not in checkpoints]
    for ref in missing:
        checkpoints[ref] = open_checkpoint(ref)
    options = MergeOptions(
        copy_tokenizer=False,
        write_model_card=False,
        allow_crimes=settings.allow_crimes,
        trust_remote_code=settings.trust_remote_code,
        device=settings.merge_device,
        random_seed=settings.random_seed if settings.random_seed is not None else 0,
    )
    plan = Planner(cfg, {r: checkpoints[r] for r in cfg.referenced_models()}, options, source).build()
    if plan.options.get("prepare"):  # regmean: its Grams are collected into an output directory's state
        raise ConfigError(
            f"{source}: `merge_method: {cfg.merge_method}` runs the models on data before merging, which "
            "candidates merged in memory cannot do; use another method"
        )
    return plan


def eval_dtype(device: str) -> torch.dtype:
    """float32 on the CPU (bf16 matmuls there are slow and lossy), the merge's bf16 on a GPU."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def merge_in_memory(plan: Plan, checkpoints: dict[str, Checkpoint], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every output tensor of `plan`, computed by the executor's `compute` and kept (the collecting sink)."""
    dtype = to_torch(plan.compute_dtype)
    explicit = bool(plan.options.get("explicit_dtype"))
    target = torch.device(device)
    return {r.name: compute(r, checkpoints, dtype, explicit, target).clone() for r in plan.recipes}


class CandidateLoader:
    """Turns merge configs into evaluation-ready models (one reused model object in memory mode)."""

    def __init__(self, settings: CandidateSettings) -> None:
        self.settings = settings
        self.checkpoints: dict[str, Checkpoint] = {}
        self._model: Any = None

    @property
    def candidate_dir(self) -> Path:
        return Path(self.settings.storage_path) / CANDIDATE_DIR

    def plan(self, config: dict[str, Any]) -> Plan:
        return plan_candidate(config, self.checkpoints, self.settings)

    def load(self, config: dict[str, Any]) -> Any:
        """The candidate's model, in eval mode on the evaluation device. On disk, call `cleanup` after scoring."""
        plan = self.plan(config)
        if self.settings.in_memory:
            return self._load_in_memory(plan)
        return self._load_from_disk(plan)

    def _skeleton(self, plan: Plan) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self._model is None:
            cfg = dict(plan.output_config)
            model_type = cfg.pop("model_type", None)
            if model_type is None:
                raise ConfigError("candidate: the output config.json has no `model_type`; use the on-disk path")
            hf_config = AutoConfig.for_model(model_type, **cfg)
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=self.settings.trust_remote_code)
            self._model = model.to(device=self.settings.device, dtype=eval_dtype(self.settings.device)).eval()
        return self._model

    def _load_in_memory(self, plan: Plan) -> Any:
        state = merge_in_memory(plan, self.checkpoints, self.settings.merge_device)
        model = self._skeleton(plan)
        result = model.load_state_dict(state, strict=False)
        tied = {n for n in result.missing_keys if n.startswith("lm_head") and _tied(model)}
        missing = [n for n in result.missing_keys if n not in tied]
        if missing or result.unexpected_keys:
            name = (missing or result.unexpected_keys)[0]
            raise ConfigError(f"candidate: merged tensors do not fit the model ({name!r}); use --no-in-memory")
        return model

    def _load_from_disk(self, plan: Plan) -> Any:
        from transformers import AutoModelForCausalLM

        from ..engine.run import RunControls, execute_plan

        out = self.candidate_dir
        self.cleanup()
        options = MergeOptions(copy_tokenizer=False, write_model_card=False, device=self.settings.merge_device)
        execute_plan(plan, self.checkpoints, out, options, controls=RunControls(overwrite=True))
        model = AutoModelForCausalLM.from_pretrained(
            out, dtype=eval_dtype(self.settings.device), trust_remote_code=self.settings.trust_remote_code
        )
        return model.to(self.settings.device).eval()

    def cleanup(self) -> None:
        """Remove the reused candidate directory (never a link: only what a merge wrote there)."""
        out = self.candidate_dir
        if out.is_symlink():
            raise ConfigError(f"{out}: is a symbolic link; refusing to write or delete through it")
        if out.exists():
            shutil.rmtree(out)


def _tied(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def load_tokenizer(genome_models: list[str], base_model: str | None, tokenizer_source: str | None,
                   trust_remote_code: bool = False) -> Any:
    """The tokenizer every candidate is scored with: `tokenizer_source` when it names a model, else the
    base model's (the first model's without a base), as the merge copies it."""
    from transformers import AutoTokenizer

    if tokenizer_source not in (None, "base") and tokenizer_source not in (*genome_models, base_model):
        raise ConfigError(
            f"`genome.tokenizer_source`: {tokenizer_source!r} builds a new vocabulary; evolve scores candidates "
            "with one model's tokenizer: name the base or one of the models"
        )
    ref = tokenizer_source if tokenizer_source not in (None, "base") else (base_model or genome_models[0])
    root = open_checkpoint(ref).root
    try:
        tok = AutoTokenizer.from_pretrained(str(root), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the user's model directory
        raise ConfigError(f"model {ref!r}: cannot load its tokenizer ({exc.__class__.__name__})") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok
