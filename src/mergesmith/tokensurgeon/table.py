"""The `transplant` recipe op: build one vocabulary tensor (embedding or output head) for the donor's
tokenizer, from the base's tensor and (for OMP and common interpolation) the donor's.

The planner decides, per tensor, which output row copies which base row and which rows are
approximated from what (vocab.Assignment); that table is content-addressed like the tokenizer
step's alignments (the plan holds only its digest, so the fingerprint is stable and a resume finds
it), and the op here applies it. Copied rows are the base's bytes exactly (the output keeps the
base tensor's dtype); approximated rows are computed in float32 and rounded once to that dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..tokenizer.align import StagedTables, write_atomic
from . import approximate as approx
from .vocab import Assignment

OP = "transplant"
NEEDS_DONOR = ("omp", "common_interpolation")
METHODS = ("omp", "common_interpolation", "subword", "mean", "zero", "randn")


@dataclass(frozen=True)
class TransplantTable:
    """`source[r]`: base row copied to output row r (-1: not copied); `target_rows[m]` is approximated
    from the donor's row `target_donor[m]`; `shared_base[s]`/`shared_donor[s]`: one shared token's rows;
    `subword[m]`: base ids of target m's text (-1 padded; empty unless the method is subword)."""

    rows: int
    source: torch.Tensor
    target_rows: torch.Tensor
    target_donor: torch.Tensor
    shared_base: torch.Tensor
    shared_donor: torch.Tensor
    subword: torch.Tensor

    @classmethod
    def of(cls, found: Assignment, subword: torch.Tensor | None = None) -> TransplantTable:
        """The table of one vocabulary tensor's row assignment (`subword`: the pieces' base ids, subword only)."""
        if subword is None:
            subword = found.target_rows.new_empty((found.target_rows.numel(), 0))
        return cls(
            found.rows,
            found.source,
            found.target_rows,
            found.target_donor,
            found.shared_base,
            found.shared_donor,
            subword,
        )

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "source": self.source,
            "target_rows": self.target_rows,
            "target_donor": self.target_donor,
            "shared_base": self.shared_base,
            "shared_donor": self.shared_donor,
            "subword": self.subword,
        }

    @property
    def digest(self) -> str:
        h = hashlib.sha256(f"transplant:{self.rows}".encode())
        for name, t in self._tensors().items():
            h.update(f"{name}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def save(self, path: Path) -> None:
        from safetensors.torch import save

        tensors = {k: v.contiguous() for k, v in self._tensors().items()}
        write_atomic(path, save(tensors, {"rows": str(self.rows)}))

    @classmethod
    def load(cls, path: Path) -> TransplantTable:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            rows = int((f.metadata() or {})["rows"])
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        return cls(
            rows, t["source"], t["target_rows"], t["target_donor"], t["shared_base"], t["shared_donor"], t["subword"]
        )


_TRANSPLANTS: StagedTables[TransplantTable] = StagedTables(
    "transplant", TransplantTable.load, "transplant table", "plan again"
)
register = _TRANSPLANTS.register
lookup = _TRANSPLANTS.lookup


def transplant_rows(
    table: TransplantTable,
    base: torch.Tensor,
    donor: torch.Tensor | None,
    params: dict[str, Any],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The output tensor [rows, hidden] in the base tensor's dtype (see the module docstring)."""
    method = str(params["method"])
    device = torch.device(str(params.get("device") or "cpu"))
    out = torch.zeros((table.rows, base.shape[1]), dtype=base.dtype)
    copied = table.source >= 0
    out[copied] = base[table.source[copied]]
    m = table.target_rows.numel()
    if m == 0:
        return out
    new = approximate(table, base, donor, method, params, generator, device)
    scale = params.get("new_vocab_scale")
    noise = params.get("new_vocab_noise")
    if noise:
        assert generator is not None, "new_vocab_noise needs a seed"
        new = new + torch.randn(new.shape, generator=generator, dtype=new.dtype) * float(noise)
    if scale:
        new = new * float(scale)
    out[table.target_rows] = new.to(base.dtype)
    return out


def approximate(
    table: TransplantTable,
    base: torch.Tensor,
    donor: torch.Tensor | None,
    method: str,
    params: dict[str, Any],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """float32 rows [M, hidden] for the tokens to approximate, on the CPU."""
    m, hidden = table.target_rows.numel(), base.shape[1]
    if method == "zero":
        return torch.zeros((m, hidden), dtype=torch.float32)
    if method == "mean":
        return base.to(torch.float32).mean(dim=0).expand(m, hidden).clone()
    if method == "randn":
        assert generator is not None, "randn needs a seed"
        return torch.randn((m, hidden), generator=generator, dtype=torch.float32)
    if method == "subword":
        return _subword(table.subword, base.to(torch.float32), str(params.get("subword_method") or "mean"), params)
    assert donor is not None, f"{method} needs the donor's tensor"
    k = int(params["k"])
    block = params.get("block")
    targets = donor[table.target_donor].to(device=device, dtype=torch.float32)
    atoms = donor[table.shared_donor].to(device=device, dtype=torch.float32)
    if method == "omp":
        indices, coeffs = approx.batch_omp(targets, atoms, k, block=block)
    elif method == "common_interpolation":
        indices, coeffs = approx.common_interpolation(
            targets,
            atoms,
            k,
            scheme=str(params.get("weight_scheme") or "distance_proportional"),
            cosine=bool(params.get("cosine_similarity")),
            block=block,
        )
    else:
        raise ValueError(f"unknown approximation method {method!r}")
    del targets, atoms
    rows = base[table.shared_base].to(device=device, dtype=torch.float32)
    return approx.apply_coefficients(indices, coeffs, rows).cpu()


def _subword(ids: torch.Tensor, base: torch.Tensor, how: str, params: dict[str, Any]) -> torch.Tensor:
    """Each token from the base rows of its pieces: mean, sum, weighted_mean (weights n..1 from the first
    piece for the embedding, 1..n for the output head: what mergekit's code does, though its comment says
    the reverse), or first_last (the last piece for the embedding, the first for the head); zero for a
    token that splits into nothing."""
    head = bool(params.get("is_head"))
    valid = ids >= 0
    rows = base[ids.clamp(min=0)] * valid.unsqueeze(-1)  # [M, L, hidden]
    count = valid.sum(dim=1)
    if how in ("mean", "sum"):
        total = rows.sum(dim=1)
        return total / count.clamp(min=1).unsqueeze(1) if how == "mean" else total
    if how == "weighted_mean":
        position = torch.arange(1, ids.shape[1] + 1, dtype=torch.float32).expand_as(ids)
        weight = torch.where(valid, position if head else (count.unsqueeze(1) + 1 - position), 0.0)
        return (rows * weight.unsqueeze(-1)).sum(dim=1) / weight.sum(dim=1).clamp(min=1).unsqueeze(1)
    if how == "first_last":
        pick = torch.zeros_like(count) if head else (count - 1).clamp(min=0)
        return torch.where((count > 0).unsqueeze(1), rows[torch.arange(ids.shape[0]), pick], 0.0)
    raise ValueError(f"unknown subword method {how!r}")


def transplant_op(recipe: Any, load: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The registered op: inputs are (base tensor) or (base tensor, donor tensor)."""
    params = dict(recipe.params)
    table = lookup(str(params["table"]))
    base = load(recipe.inputs[0])
    donor = load(recipe.inputs[1]) if len(recipe.inputs) > 1 else None
    generator = None
    if recipe.seed is not None:
        generator = torch.Generator().manual_seed(recipe.seed)
    return transplant_rows(table, base, donor, params, generator)
