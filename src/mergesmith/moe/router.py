"""Router weights: one gate vector per expert and layer, from prompts or at random.

The semantics are mergekit-moe's. For the prompt modes an expert's vector is what the base model
"looks like" on that expert's positive prompts (minus its negative prompts), normalised per layer,
so a token resembling those prompts scores highest for that expert:

- `hidden` (`hidden_last`): the residual stream entering each layer at the prompt's last token,
  averaged over prompts (a base-model forward pass, batched, on `--device`);
- `hidden_avg`: the same averaged over each prompt's tokens first;
- `cheap_embed`: the sum of the prompts' token embeddings, the same vector for every layer;
- `random`: standard normal; `uniform_random`: U(-1/sqrt(hidden), 1/sqrt(hidden)), like nn.Linear.

Prompts are tokenized with the base model's tokenizer, its BOS token first. A base given as
`model+lora` is the adapted model throughout: its tokenizer is the adapter's when it ships one, and
the `hidden` forward pass runs with the adapter's tensors written over the plain model's.

These weights are in no input checkpoint, so they are written once to a small safetensors file in a
cache directory, named by a hash of everything that decides them (mode, prompts, seed, base model
files, tokenizer, library versions for `hidden`), and the executor reads them like any input.
The plan's fingerprint uses that hash, not the file, so a rerun resumes even if the cache was
cleared, and any change of prompts or mode gives a different plan. The plan itself never needs the
values: `mergesmith plan` runs no forward pass. The cache directory is opened without following links
(cache_root.open_cache_dir: a link planted as `moe-router/` is refused in one line), a cache entry that
is a link is not trusted (recomputed, and the link replaced), and a new entry is created new under a
unique temporary name and renamed between descriptors of that directory (io/safe_fs.py).

transformers is imported here only, and only when a prompt mode needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..engine.planning.shared import tensor_seed
from ..errors import CheckpointError
from ..io import safe_fs
from ..io.checkpoint import Checkpoint, TensorInfo, read_safetensors_header
from ..io.model_files import TOKENIZER_FILES
from ..runtime.cache_root import cache_root, open_cache_dir
from .config import PROMPT_MODES, Expert

ROUTER_MODEL = "<router weights>"
"""The name plans use for the router-weights file among their inputs (never a valid model path)."""
PROMPT_BATCH = 8
DEGENERATE_COND = 5.0

GateProgress = Callable[[int, int], None]


CACHE_SUBDIR = "moe-router"


def cache_dir() -> Path:
    """Where router weights are kept: under mergesmith's cache directory (cache_root)."""
    return cache_root() / CACHE_SUBDIR


def router_tensor(layer: int) -> str:
    return f"router.{layer}"


def shared_router_tensor(layer: int) -> str:
    return f"shared_router.{layer}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def _tokenizer_root(base: Checkpoint) -> Path:
    """Where the base's tokenizer lives (an adapter may ship its own, see io/lora_adapter.py)."""
    return Path(getattr(base, "tokenizer_root", base.root))


def _tokenizer_digest(root: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return h.hexdigest()


@dataclass
class GateJob:
    """The router weights one MoE plan needs: what decides them, and how to compute them on demand.

    `prompted` lists the experts whose rows come from prompts (routed experts, then the shared expert
    when the output gates it); in the random modes every row is drawn, `rows` of them.
    """

    mode: str
    base: Checkpoint
    prompted: list[Expert]
    num_experts: int
    shared_row: bool
    layers: int
    hidden: int
    seed: int | None
    embed_name: str | None
    device: str = "cpu"
    trust_remote_code: bool = False
    key: str = field(init=False)
    _infos: dict[str, TensorInfo] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = self._key()

    @property
    def rows(self) -> int:
        return self.num_experts + (1 if self.shared_row else 0)

    def _key(self) -> str:
        payload: dict[str, Any] = {
            "format": 1,
            "mode": self.mode,
            "layers": self.layers,
            "hidden": self.hidden,
            "rows": self.rows,
        }
        if self.mode in PROMPT_MODES:
            payload["prompts"] = [[e.positive_prompts or [], e.negative_prompts or []] for e in self.prompted]
            payload["base"] = [list(x) for x in self.base.identity()]
            payload["tokenizer"] = _tokenizer_digest(_tokenizer_root(self.base))
            if self.mode == "cheap_embed":
                payload["embedding"] = self.embed_name
            else:  # a forward pass: the numbers may move with the libraries and the device
                payload["libraries"] = [_version("torch"), _version("transformers")]
                payload["device"] = self.device
        else:
            payload["seed"] = self.seed
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    @property
    def path(self) -> Path:
        return cache_dir() / f"{self.key[:40]}.safetensors"

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """The router file's tensors, known before it exists (for planning and estimates). Made once: the planner
        asks for one tensor's at a time, and building all layers' each time made a plan quadratic in the layers
        (a 1,000-layer, 4-expert assembly spent 40 of its 56 s here)."""
        if self._infos is None:
            path = self.path
            infos = {}
            for layer in range(self.layers):
                name = router_tensor(layer)
                infos[name] = TensorInfo(name, "F32", (self.num_experts, self.hidden), path)
                if self.shared_row:
                    name = shared_router_tensor(layer)
                    infos[name] = TensorInfo(name, "F32", (1, self.hidden), path)
            self._infos = infos
        return self._infos

    def materialize(self, on_progress: GateProgress | None = None) -> tuple[Checkpoint, list[str]]:
        """The router weights as a checkpoint, computed and cached unless already in the cache.

        Returns the checkpoint and warnings (layers whose gate vectors are nearly linearly dependent,
        so that some expert will hardly ever be chosen).
        """
        path = self.path
        dfd = open_cache_dir(CACHE_SUBDIR)  # a link there: LinkError, one line
        try:
            cached = stat.S_ISREG(os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except OSError:
            cached = False
        finally:
            os.close(dfd)
        if cached:
            try:
                ckpt = Checkpoint.open(str(path))
                _tensors, meta, _raw = read_safetensors_header(path)
                if {n: (i.dtype, i.shape) for n, i in ckpt.tensors.items()} == {
                    n: (i.dtype, i.shape) for n, i in self.tensor_infos().items()
                }:
                    return ckpt, json.loads(meta.get("warnings", "[]"))
            except (CheckpointError, ValueError):
                pass  # a damaged cache entry: compute it again
        gates = compute_gates(self, on_progress)
        warnings = degenerate_layers(gates) if self.mode in PROMPT_MODES else []
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(self.layers):
            tensors[router_tensor(layer)] = gates[layer, : self.num_experts].contiguous()
            if self.shared_row:
                tensors[shared_router_tensor(layer)] = gates[layer, self.num_experts :].contiguous()
        _save_atomic(path, tensors, {"mode": self.mode, "key": self.key, "warnings": json.dumps(warnings)})
        return Checkpoint.open(str(path)), warnings


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata_: dict[str, str]) -> None:
    """Write under a unique temporary name and rename, so concurrent runs never see half a file; both
    inside a descriptor of the cache directory, never through a link (io/safe_fs.py)."""
    from safetensors.torch import save

    dfd = open_cache_dir(CACHE_SUBDIR)
    tmp = f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        safe_fs.write_new_file(dfd, tmp, save(tensors, metadata=metadata_))
        safe_fs.replace_atomically(dfd, tmp, dfd, path.name)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    finally:
        os.close(dfd)


def compute_gates(job: GateJob, on_progress: GateProgress | None = None) -> torch.Tensor:
    """Gate vectors [layers, rows, hidden] in float32 (routed experts first, then the shared one)."""
    shape = (job.layers, job.rows, job.hidden)
    if job.mode in ("random", "uniform_random"):
        assert job.seed is not None
        generator = torch.Generator().manual_seed(tensor_seed(job.seed, "moe.router"))
        if job.mode == "random":
            return torch.randn(shape, generator=generator, dtype=torch.float32)
        bound = job.hidden**-0.5
        return torch.rand(shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
    tokenizer = _load_tokenizer(job)
    groups: list[list[list[int]]] = []  # per row: positive prompts' ids, then negative (if any)
    for expert in job.prompted:
        groups.append([_encode(tokenizer, p) for p in expert.positive_prompts or []])
        groups.append([_encode(tokenizer, p) for p in expert.negative_prompts or []])
    total = sum(len(g) for g in groups)
    done = 0
    if on_progress is not None:
        on_progress(0, total)

    if job.mode == "cheap_embed":
        assert job.embed_name is not None
        embed = job.base.get(job.embed_name).to(torch.float32)

        def represent(prompts: list[list[int]]) -> torch.Tensor:
            ids = torch.tensor([i for p in prompts for i in p], dtype=torch.long)
            summed = embed[ids].sum(dim=0)
            return (summed / summed.norm().clamp(min=1e-8)).expand(job.layers, -1)

    else:
        model = _load_model(job)
        pad_id = _pad_id(tokenizer)

        def represent(prompts: list[list[int]]) -> torch.Tensor:
            nonlocal done
            acc = torch.zeros((job.layers, job.hidden), dtype=torch.float32)
            for start in range(0, len(prompts), PROMPT_BATCH):
                batch = prompts[start : start + PROMPT_BATCH]
                acc += _hidden_batch(model, batch, pad_id, job.mode == "hidden_avg", job.device).sum(dim=1)
                done += len(batch)
                if on_progress is not None:
                    on_progress(done, total)
            return acc / len(prompts)

    rows = []
    for i in range(len(job.prompted)):
        positive, negative = groups[2 * i], groups[2 * i + 1]
        vec = represent(positive)
        if negative:
            vec = vec - represent(negative)
        rows.append(vec / vec.norm(dim=-1, keepdim=True).clamp(min=1e-8))
        if job.mode == "cheap_embed":
            done += len(positive) + len(negative)
            if on_progress is not None:
                on_progress(done, total)
    return torch.stack(rows, dim=1).contiguous()


def _hidden_batch(model: Any, batch: list[list[int]], pad_id: int, average: bool, device: str) -> torch.Tensor:
    """Residual-stream input of every layer for each prompt: [layers, batch, hidden].

    Prompts are left-padded with explicit position ids, so each prompt's states equal those of the
    prompt run alone (padding changes neither its positions nor what it attends to).
    """
    longest = max(len(p) for p in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            output_hidden_states=True,
            use_cache=False,
        )
    # hidden_states: the embeddings, then each layer's output (the last after the final norm);
    # dropping the last leaves what enters each layer.
    states = torch.stack(out.hidden_states[:-1]).to("cpu", torch.float32)  # [layers, batch, seq, hidden]
    if not average:
        return states[:, :, -1, :]
    weights = mask.to(torch.float32)[None, :, :, None]
    return (states * weights).sum(dim=2) / weights.sum(dim=2)


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not ids:
        raise CheckpointError(f"the base model's tokenizer turns prompt {prompt!r} into no tokens")
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def _pad_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _declared_tokenizer_class(root: Path) -> str | None:
    try:
        return json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _load_tokenizer(job: GateJob) -> Any:
    """The base model's tokenizer, as the checkpoint declares it.

    A checkpoint that declares the generic fast tokenizer gets exactly its tokenizer.json: transformers 5's
    AutoTokenizer would substitute a class chosen by model type (Qwen2Tokenizer for a qwen2 model), which
    rebuilds the tokenizer from vocab and merges and can disagree with the file.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = _tokenizer_root(job.base)
    generic = _declared_tokenizer_class(root) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    try:
        if generic and (root / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(root))
        return AutoTokenizer.from_pretrained(str(root), trust_remote_code=job.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure here is "this base has no usable tokenizer"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise CheckpointError(
            f"base_model {job.base.ref!r}: cannot load its tokenizer, which gate_mode {job.mode} needs to read "
            f"the prompts ({first})"
        ) from None


def _load_model(job: GateJob) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    try:
        # The checkpoint's own dtype: no weight loses precision, and memory stays the model's size.
        model = AutoModelForCausalLM.from_pretrained(
            str(job.base.root), dtype="auto", trust_remote_code=job.trust_remote_code
        )
    except Exception as exc:  # noqa: BLE001 - one line naming the model instead of a transformers traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise CheckpointError(
            f"base_model {job.base.ref!r}: transformers cannot load it for gate_mode {job.mode} ({first})"
        ) from None
    _apply_checkpoint_tensors(model, job.base)
    return model.to(job.device).eval()


def _apply_checkpoint_tensors(model: Any, base: Checkpoint) -> None:
    """Write the tensors a LoRA input changes (`model+lora`: merged deltas, saved modules) over the
    plain model transformers loaded from its root, so the forward pass sees the adapted model."""
    from ..io.lora_adapter import LoraCheckpoint

    if not isinstance(base, LoraCheckpoint):
        return
    state = model.state_dict()
    changed = base.adapted_tensors
    missing = [name for name in changed if name not in state]
    if missing:
        raise CheckpointError(
            f"base_model {base.ref!r}: the adapter changes {missing[0]!r}, which the transformers model "
            "loaded for the router has no parameter for"
        )
    with torch.no_grad():
        for name in changed:
            target = state[name]
            tensor = base.get(name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"base_model {base.ref!r}: {name!r} is {list(tensor.shape)} with the adapter, "
                    f"{list(target.shape)} in the transformers model"
                )
            target.copy_(tensor.to(target.dtype))


def degenerate_layers(gates: torch.Tensor, threshold: float = DEGENERATE_COND) -> list[str]:
    """A warning when some layer's gate vectors are nearly dependent (condition number over `threshold`):
    the prompts are too alike there, and some expert will rarely win."""
    bad = [i for i in range(gates.shape[0]) if float(torch.linalg.cond(gates[i].to(torch.float64))) > threshold]
    if not bad:
        return []
    where = "every layer" if len(bad) == gates.shape[0] else "layer" + ("s " if len(bad) > 1 else " ")
    if len(bad) < gates.shape[0]:
        where += ", ".join(str(i) for i in bad)
    return [
        f"router weights are nearly degenerate in {where}: the experts' prompts look alike to the base model, "
        "so some experts will rarely be chosen"
    ]
