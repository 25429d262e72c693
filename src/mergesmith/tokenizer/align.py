"""Re-indexing embedding and lm_head rows onto the output vocabulary, as data the executor applies.

The planner turns the output tokenizer into one `Alignment` per group of models feeding a
vocabulary tensor: for each model and output token, the model's own row to use (or -1), and the
rows whose mean fills the tokens a model lacks (or is forced to replace). The executor's
`vocab_merge` op applies it to the raw input tensors, then runs the merge method on the aligned
tensors, so every method sees inputs whose row i means the same token.

Fill rules (mergekit's, for tokens a model lacks, or any token with `force: true`):
1. a `tokenizer.tokens` entry decides: a model's row for the token, a `model_token` (a given token
   or id of a given model), or `zero`;
2. otherwise, a token that only one model has takes that model's row;
3. else the base model's row, when the base feeds the tensor and has the token;
4. else the mean of the rows of every model that has it (zero when none has it).
Rows added by `pad_to_multiple_of` are the mean of the model's aligned rows.

Tables are content-addressed: the plan holds only the digest (so its fingerprint is stable across
runs and resume works), the process keeps the table in memory, and a copy in the staging directory
lets another process running the same plan find it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from ..errors import ConfigError
from ..io import safe_fs

VOCAB_OP = "vocab_merge"
MAP_PARAM = "vocab_map"
DTYPE_PARAM = "vocab_compute_dtype"
T = TypeVar("T")
_OWN_PARAMS = (MAP_PARAM, DTYPE_PARAM)


def staging_root() -> Path:
    """Where planned tokenizer files and alignment tables wait for the executor (content-addressed)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    if os.environ.get("MERGESMITH_STAGING"):
        return Path(os.environ["MERGESMITH_STAGING"])  # the user's choice, trusted as given
    # A predictable name in a shared /tmp: someone else may have made it first (safe_fs.private_dir).
    return safe_fs.private_dir(Path(tempfile.gettempdir()) / f"mergesmith-{uid}")


class StagedTables(Generic[T]):
    """Digest-keyed tables kept for this process and saved in the staging directory, where the executor's
    Ray workers (other processes) load them. `load` reads one back; `what` and `hint` word the refusal
    when a digest is missing or its file does not match it."""

    def __init__(self, folder: str, load: Callable[[Path], T], what: str, hint: str) -> None:
        self.folder, self.load, self.what, self.hint = folder, load, what, hint
        self._tables: dict[str, T] = {}
        self._lock = threading.Lock()

    def path(self, digest: str) -> Path:
        return staging_root() / self.folder / f"{digest}.safetensors"

    def register(self, table: T) -> str:
        """Keep `table` here and in the staging directory; returns its digest."""
        digest: str = table.digest  # type: ignore[attr-defined]
        with self._lock:
            self._tables[digest] = table
        path = self.path(digest)
        if not path.is_file():
            table.save(path)  # type: ignore[attr-defined]
        return digest

    def lookup(self, digest: str) -> T:
        with self._lock:
            table = self._tables.get(digest)
        if table is not None:
            return table
        path = self.path(digest)
        if not path.is_file():
            raise RuntimeError(f"{self.what} {digest[:12]} is not available here; {self.hint}")
        table = self.load(path)
        if table.digest != digest:  # type: ignore[attr-defined]
            raise RuntimeError(f"{self.what} {digest[:12]} in {path} is corrupt; {self.hint}")
        with self._lock:
            self._tables[digest] = table
        return table


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (concurrent planners of the same merge may race here)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Alignment:
    """`own[j, t]`: model j's row for output token t, or -1 to use the fill; `fill[j, t]`: the row of
    model j that contributes to token t's fill (fills are means over contributing models), or -1;
    `rows`: output rows (>= number of tokens when padded)."""

    own: torch.Tensor
    fill: torch.Tensor
    rows: int

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"{tuple(self.own.shape)}:{self.rows}".encode())
        h.update(self.own.contiguous().numpy().tobytes())
        h.update(self.fill.contiguous().numpy().tobytes())
        return h.hexdigest()

    def apply(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Each model's tensor with its rows re-indexed to the output vocabulary, in `dtype`."""
        if len(tensors) != self.own.shape[0]:
            raise ValueError(f"alignment for {self.own.shape[0]} models applied to {len(tensors)} tensors")
        ntok = self.own.shape[1]
        tail = tuple(tensors[0].shape[1:])
        missing = self.own < 0
        fill_tokens = torch.nonzero(missing.any(0)).flatten()
        slot = torch.full((ntok,), -1, dtype=torch.long)
        slot[fill_tokens] = torch.arange(fill_tokens.numel())
        fills = torch.zeros((fill_tokens.numel(), *tail), dtype=dtype)
        if fill_tokens.numel():
            count = torch.zeros(fill_tokens.numel(), dtype=dtype)
            for j, tensor in enumerate(tensors):
                src = self.fill[j, fill_tokens]
                has = src >= 0
                if bool(has.any()):
                    fills[has] += tensor[src[has]].to(dtype)
                    count += has.to(dtype)
            fills /= count.clamp(min=1).reshape(-1, *([1] * len(tail)))
        out = []
        for j, tensor in enumerate(tensors):
            aligned = torch.empty((self.rows, *tail), dtype=dtype)
            own = self.own[j]
            mine = own >= 0
            body = aligned[:ntok]
            body[mine] = tensor[own[mine]].to(dtype)
            body[~mine] = fills[slot[~mine]]
            if self.rows > ntok:
                aligned[ntok:] = body.mean(dim=0)
            out.append(aligned)
        return out

    def save(self, path: Path) -> None:
        from safetensors.torch import save

        data = save({"own": self.own.contiguous(), "fill": self.fill.contiguous()}, {"rows": str(self.rows)})
        write_atomic(path, data)

    @classmethod
    def load(cls, path: Path) -> Alignment:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            rows = int((f.metadata() or {})["rows"])
            return cls(f.get_tensor("own"), f.get_tensor("fill"), rows)


_ALIGNMENTS: StagedTables[Alignment] = StagedTables(
    "tables", Alignment.load, "vocabulary alignment", "plan the merge again"
)
register = _ALIGNMENTS.register
lookup = _ALIGNMENTS.lookup


TokenRule = tuple[str, Any]  # ("model", (index, row)) | ("zero", None) | ("default", None)


def build_alignment(
    permutations: Sequence[torch.Tensor],
    base_index: int | None,
    rows: int,
    rules: dict[int, tuple[TokenRule, bool]],
) -> Alignment:
    """The alignment for models with these output-id -> own-row maps.

    `rules[t] = (rule, force)` for tokens configured under `tokenizer.tokens` (by output id);
    every other token follows the default fill rules in the module docstring.
    """
    perm = torch.stack(list(permutations))  # [models, tokens]
    present = perm >= 0
    count = present.sum(dim=0)
    needs = ~present.all(dim=0)
    fill = torch.where(present & needs, perm, torch.full_like(perm, -1))  # rule 2 and rule 4
    if base_index is not None:
        by_base = needs & (count > 1) & present[base_index]  # rule 3
        fill[:, by_base] = -1
        fill[base_index, by_base] = perm[base_index, by_base]
    own = perm.clone()
    for t, ((kind, value), force) in rules.items():
        if kind == "default":
            if force:
                fill[:, t] = torch.where(present[:, t], perm[:, t], -1)
                if base_index is not None and count[t] > 1 and present[base_index, t]:
                    fill[:, t] = -1
                    fill[base_index, t] = perm[base_index, t]
        else:
            fill[:, t] = -1
            if kind == "model":
                j, row = value
                fill[j, t] = row
        if force:
            own[:, t] = -1
    return Alignment(own, fill, rows)


def parse_token_rules(
    tokens: dict[str, Any] | None,
    vocab: dict[str, int],
    refs: Sequence[str],
    permutations: Sequence[torch.Tensor],
    original_vocabs: dict[str, dict[str, int]],
    model_rows: dict[str, int],
    tensor: str,
    source: str,
) -> dict[int, tuple[TokenRule, bool]]:
    """`tokenizer.tokens` as rules for the models `refs` feeding `tensor`; one-line errors name the key."""
    rules: dict[int, tuple[TokenRule, bool]] = {}
    for token, cfg in (tokens or {}).items():
        key = f"{source}: `tokenizer.tokens.{token}.source`"
        t = vocab[token]
        spec = cfg.source
        if spec is None:
            rules[t] = (("default", None), cfg.force)
            continue
        if isinstance(spec, str):
            j = _model_index(spec, refs, key, tensor)
            row = int(permutations[j][t])
            if row < 0:
                raise ConfigError(f"{key}: model {spec!r} has no token {token!r}")
            rules[t] = (("model", (j, row)), cfg.force)
            continue
        kind = spec.get("kind")
        if kind == "zero":
            if set(spec) - {"kind"}:
                raise ConfigError(f"{key}: `zero` takes no other keys, got {sorted(set(spec) - {'kind'})}")
            rules[t] = (("zero", None), cfg.force)
        elif kind == "model_token":
            unknown = set(spec) - {"kind", "model", "token", "token_id"}
            if unknown:
                raise ConfigError(f"{key}: unknown key `{sorted(unknown)[0]}` for kind model_token")
            model = spec.get("model")
            if not isinstance(model, str):
                raise ConfigError(f"{key}: kind model_token needs `model`")
            if ("token" in spec) == ("token_id" in spec):
                raise ConfigError(f"{key}: kind model_token needs exactly one of `token` or `token_id`")
            j = _model_index(model, refs, key, tensor)
            if "token" in spec:
                row = original_vocabs[model].get(str(spec["token"]), -1)
                if row < 0:
                    raise ConfigError(f"{key}: model {model!r} has no token {spec['token']!r}")
            else:
                row = spec["token_id"]
                if not isinstance(row, int) or isinstance(row, bool):
                    raise ConfigError(f"{key}: `token_id` must be an integer, got {row!r}")
            if not 0 <= row < model_rows[model]:
                raise ConfigError(f"{key}: token id {row} is outside model {model!r}'s {model_rows[model]} rows")
            rules[t] = (("model", (j, row)), cfg.force)
        else:
            raise ConfigError(f"{key}: `kind` must be model_token or zero, got {kind!r}")
    return rules


def _model_index(model: str, refs: Sequence[str], key: str, tensor: str) -> int:
    if model not in refs:
        listed = ", ".join(repr(r) for r in dict.fromkeys(refs))
        raise ConfigError(f"{key}: model {model!r} does not feed {tensor!r} (its models: {listed})")
    return list(refs).index(model)


def merge_vocabulary(recipe: Any, load: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The `vocab_merge` op: align every input to the output vocabulary, then run the merge method."""
    from ..io.dtypes import to_torch

    params = dict(recipe.params)
    table = lookup(str(params[MAP_PARAM]))
    dtype = to_torch(str(params[DTYPE_PARAM]))
    method_params = {k: v for k, v in params.items() if k not in _OWN_PARAMS}
    aligned = table.apply([load(ref) for ref in recipe.inputs], dtype)
    return merge_rows(recipe, aligned, method_params)


def merge_rows(recipe: Any, aligned: list[torch.Tensor], params: dict[str, Any]) -> torch.Tensor:
    """Run the recipe's merge method over inputs already brought onto the output's rows (the first of them
    when the recipe copies), seeded as the executor seeds it: a generator, and the keyed stream DARE/DELLA
    draw from by position. Shared by the vocabulary-aligned merge and the tokenizer transplant's merge."""
    from ..kernels.keyed_random import MaskStream
    from ..methods import MergeInputs, require_method

    if recipe.method is None:
        return aligned[0]
    generator = None
    if recipe.seed is not None:
        generator = torch.Generator()
        generator.manual_seed(recipe.seed)
    return require_method(recipe.method).merge(
        MergeInputs(
            tensors=aligned,
            base_index=recipe.base_index,
            model_params=[dict(p) for p in recipe.model_params],
            params=params,
            generator=generator,
            tensor_name=recipe.name,
            stream=MaskStream(recipe.seed) if recipe.seed is not None else None,  # DARE/DELLA draw by position
        )
    )
