"""The genome: which numbers the search moves, and how a vector of them becomes a merge config.

Semantics follow mergekit-evolve (learned from its docs and code, written anew): the genotype is an
array [layer groups, models, parameter sets, method parameters] flattened for CMA-ES. A layer group
is `layer_granularity` consecutive layers (0: the whole stack is one group); a parameter set is one
per entry of `filters` (values for tensors whose name contains the filter) plus one for the rest.
`weight`/`t` take absolute values unless `allow_negative_weights`; `density` is |x| clipped to [0, 1].
`smooth` turns each model's per-group values into a gradient over the layers (a `models:` config)
instead of one slice per group. SLERP picks, per group, the two models with the largest first value
and interpolates with t = softmax of those two values.

Methods beyond mergekit-evolve's five are searched over their per-model numeric parameters (from
the method registry), and a base model is required only when the method itself requires one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..io.references import open_checkpoint
from ..methods import MethodSpec, require_method
from .config import GenomeDefinition

KNOWN_PARAMETERS = {
    "linear": ("weight",),
    "task_arithmetic": ("weight",),
    "ties": ("weight", "density"),
    "dare_ties": ("weight", "density"),
    "slerp": ("t",),
}
SIGNED = ("weight", "t")
UNIT_INTERVAL = ("density",)


def method_parameters(spec: MethodSpec) -> tuple[str, ...]:
    """The parameters a genome searches for a method: mergekit-evolve's for its five methods, else the
    method's per-model parameters whose values are numbers (weight first)."""
    if spec.name in KNOWN_PARAMETERS:
        return KNOWN_PARAMETERS[spec.name]
    names = [
        p.name
        for p in spec.model_params
        if p.choices is None and not isinstance(p.default, bool) and (p.required or isinstance(p.default, int | float))
    ]
    names.sort(key=lambda n: n != "weight")
    return tuple(names)


@dataclass
class Genome:
    """A validated genome over opened model headers."""

    definition: GenomeDefinition
    num_layers: int
    spec: MethodSpec
    parameters: tuple[str, ...]
    dtype: str = "bfloat16"

    @classmethod
    def build(cls, definition: GenomeDefinition, source: str, dtype: str = "bfloat16") -> Genome:
        spec = require_method(definition.merge_method, f"{source}: `genome.merge_method`")
        params = method_parameters(spec)
        if not params:
            raise ConfigError(
                f"{source}: `genome.merge_method`: method {spec.name!r} has no numeric per-model parameters to search"
            )
        if spec.requires_base and not definition.base_model and spec.name != "slerp":  # slerp: a base per slice
            raise ConfigError(f"{source}: `genome.base_model`: method {spec.name!r} requires a base model")
        if spec.name == "slerp" and (definition.smooth or definition.filters):
            raise ConfigError(f"{source}: `genome`: `smooth` and `filters` are not supported with slerp")
        if spec.name == "slerp" and len(definition.models) < 2:
            raise ConfigError(f"{source}: `genome.models`: slerp needs at least two models")
        layers: dict[str, int] = {}
        for ref in [*definition.models, *([definition.base_model] if definition.base_model else [])]:
            ckpt = open_checkpoint(ref)
            n = (ckpt.config or {}).get("num_hidden_layers")
            if not isinstance(n, int):
                raise ConfigError(f"{source}: model {ref!r}: its config.json has no `num_hidden_layers`")
            layers[ref] = n
        counts = set(layers.values())
        if len(counts) > 1:
            raise ConfigError(
                f"{source}: `genome.models`: layer counts differ ({', '.join(f'{k}: {v}' for k, v in layers.items())})"
            )
        num_layers = counts.pop()
        g = definition.layer_granularity
        if g > 0 and num_layers % g:
            raise ConfigError(
                f"{source}: `genome.layer_granularity`: {g} does not divide the models' {num_layers} layers"
            )
        return cls(definition, num_layers, spec, params, dtype)

    # -- shape ---------------------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        g = self.definition.layer_granularity
        return self.num_layers // g if g > 0 else 1

    @property
    def group_size(self) -> int:
        return self.num_layers // self.groups

    @property
    def param_sets(self) -> int:
        return len(self.definition.filters or []) + 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.groups, len(self.definition.models), self.param_sets, len(self.parameters))

    @property
    def dimension(self) -> int:
        return int(np.prod(self.shape))

    def initial(self, random: bool = False, rng: np.random.Generator | None = None) -> np.ndarray:
        """x0: weights 1/n and other parameters 1 (mergekit-evolve's start), or uniform [0, 1) draws."""
        if random:
            return (rng or np.random.default_rng(0)).random(self.dimension)
        x = np.ones(self.shape)
        x[..., 0] = 1.0 / len(self.definition.models)
        return x.reshape(-1)

    def names(self) -> list[str]:
        """A readable name for every coordinate: group, model, parameter and filter."""
        out = []
        filters = [*(self.definition.filters or []), None]
        for g in range(self.groups):
            for _m, model in enumerate(self.definition.models):
                for _s, f in enumerate(filters):
                    for p in self.parameters:
                        first, last = g * self.group_size, (g + 1) * self.group_size - 1
                        where = f"layers {first}-{last}" if self.groups > 1 else ""
                        name = f"{_short(model)}.{p}" + (f"[{f}]" if f else "") + (f" ({where})" if where else "")
                        out.append(name)
        return out

    # -- candidate -> merge config ------------------------------------------------------------------------------
    def values(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The genotype as arrays [group, model, set] per parameter, after mergekit-evolve's transforms."""
        arr = np.asarray(x, dtype=np.float64).reshape(self.shape)
        out = {}
        for i, name in enumerate(self.parameters):
            v = arr[..., i]
            if name in UNIT_INTERVAL:
                v = np.clip(np.abs(v), 0.0, 1.0)
            elif name in SIGNED and not self.definition.allow_negative_weights:
                v = np.abs(v)
            out[name] = v
        return out

    def merge_config(self, x: np.ndarray) -> dict[str, Any]:
        """A plain mergekit-format merge config (what `mergesmith merge` runs) for candidate `x`."""
        d = self.definition
        config: dict[str, Any] = {"merge_method": self.spec.name}
        if self.spec.name == "slerp":
            config["slices"] = self._slerp_slices(np.asarray(x, dtype=np.float64).reshape(self.shape))
        else:
            values = self.values(x)
            if d.smooth:
                config["models"] = self._smooth_models(values)
            else:
                config["slices"] = self._slices(values)
        globals_: dict[str, Any] = {}
        declared = {p.name for p in self.spec.params}
        if "normalize" in declared:
            normalize = d.normalize if d.normalize is not None else self.spec.name in ("ties", "dare_ties", "linear")
            globals_["normalize"] = bool(normalize)
        if "int8_mask" in declared:
            globals_["int8_mask"] = True
        if globals_:
            config["parameters"] = globals_
        if d.base_model:
            config["base_model"] = d.base_model
        config["dtype"] = self.dtype
        if d.tokenizer_source:
            config["tokenizer_source"] = d.tokenizer_source
        return config

    def _params_at(self, values: dict[str, np.ndarray], group: slice | int, model: int) -> dict[str, Any]:
        filters = self.definition.filters or []
        params: dict[str, Any] = {}
        for name, v in values.items():
            at = [_plain(v[group, model, s]) for s in range(len(filters) + 1)]
            if filters:
                params[name] = [{"filter": f, "value": at[s]} for s, f in enumerate(filters)] + [{"value": at[-1]}]
            else:
                params[name] = at[0]
        return params

    def _base_source(self, start: int, end: int) -> list[dict[str, Any]]:
        d = self.definition
        if d.base_model and d.base_model not in d.models:
            return [{"model": d.base_model, "layer_range": [start, end]}]
        return []

    def _slices(self, values: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        slices = []
        for g in range(self.groups):
            start, end = g * self.group_size, (g + 1) * self.group_size
            sources = [
                {"model": model, "layer_range": [start, end], "parameters": self._params_at(values, g, m)}
                for m, model in enumerate(self.definition.models)
            ]
            slices.append({"sources": sources + self._base_source(start, end)})
        return slices

    def _smooth_models(self, values: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        models = [
            {"model": model, "parameters": self._params_at(values, slice(None), m)}
            for m, model in enumerate(self.definition.models)
        ]
        d = self.definition
        if d.base_model and d.base_model not in d.models:
            models.append({"model": d.base_model})
        return models

    def _slerp_slices(self, arr: np.ndarray) -> list[dict[str, Any]]:
        slices = []
        models = self.definition.models
        for g in range(self.groups):
            start, end = g * self.group_size, (g + 1) * self.group_size
            first = arr[g, :, 0, 0]
            order = sorted(range(len(models)), key=lambda i: (-first[i], i))[:2]
            a, b = first[order[0]], first[order[1]]
            t = float(np.exp(b - max(a, b)) / (np.exp(a - max(a, b)) + np.exp(b - max(a, b))))
            sources = [{"model": models[i], "layer_range": [start, end]} for i in order]
            slices.append(
                # the slice's own base is the stronger model; slerp takes exactly two, so no genome base here
                {"sources": sources, "base_model": models[order[0]], "parameters": {"t": t}}
            )
        return slices


def _plain(v: Any) -> Any:
    """A float or a list of floats (one per layer group), as YAML writes them plainly."""
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim == 0:
        return float(arr)
    values = [float(a) for a in arr.reshape(-1)]
    return values[0] if len(values) == 1 else values


def _short(ref: str) -> str:
    return ref.rstrip("/").split("/")[-1] or ref
