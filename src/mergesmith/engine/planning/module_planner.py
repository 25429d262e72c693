"""mergekit's `modules:` form: a model made of several modules, each merged by its own definition.

mergekit 0.1.5 describes a model as named modules, each with its own layer stack and loose weights: one
module, `default`, for a language model; `text_decoder`, `vision_tower` and `multi_modal_projector` for
the vision-language models it has tables for (qwen2_vl, gemma3, mistral3, ...); and, for one it has no
table for (llava), modules named after the prefixes of the layer stacks it finds. A config may give each
module its own `models` or `slices` and `parameters` (between a slice's and the top level's in
precedence); a plain `models:` config merges every module with the same models.

Here modules are found the way engine/planning/architecture.py finds the layers, without tables: the text stack is
the one whose depth the config names; every other stack (`<prefix>.<N>.`) is a module of its own, a
vision tower when its prefix says `vision`/`visual`; loose tensors belong to the module whose prefix
they share (`vision_tower.embeddings...`), to `multi_modal_projector` when their name says projector or
merger, else to the text decoder. A module answers to mergekit's name for it and to its stack's prefix
(both the checkpoint's spelling and the one transformers' current layout gives, which is what mergekit's
inference prints). A module the base model has but the config does not name is copied from the base
model with a warning (mergekit would leave its tensors out, and the output would not load). A module the
config names that the model lacks, `slices` for a module with no layers, or `default` for a model with
several modules are refused at plan time, before any tensor is read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...config import OutputModuleDefinition
from ...errors import CheckpointError, ConfigError
from ...io.dtypes import is_float
from ..plan import InputRef, Plan, TensorRecipe
from .architecture import LM_HEAD_NAMES, LayerStack, find_layer_stack, is_embedding, ties_embeddings
from .merge_planner import NormalizedSlice, Planner, SourceRange

_LAYER_RE = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_PROJECTOR_MARKERS = ("projector", "merger")
_DEPTH_KEYS = ("num_hidden_layers", "depth", "num_layers", "n_layers")


@dataclass(frozen=True)
class ModuleLayout:
    """One module of one checkpoint: its name, other names it answers to, layer stack, loose tensors."""

    name: str
    aliases: tuple[str, ...]
    stack: LayerStack | None
    loose: tuple[str, ...]
    is_text: bool

    def answers_to(self, name: str) -> bool:
        return name == self.name or name in self.aliases


def _components(prefix: str) -> list[str]:
    return prefix.split(".")


def _root(prefix: str, others: list[str]) -> str:
    """The shortest leading part of `prefix` (whole components) that leads no other stack's prefix."""
    parts = _components(prefix)
    for n in range(1, len(parts) + 1):
        head = ".".join(parts[:n])
        if not any(o == head or o.startswith(head + ".") for o in others):
            return head
    return prefix


def _stack_aliases(prefix: str) -> tuple[str, ...]:
    """The stack's prefix as the checkpoint spells it and as transformers' current layout does
    (`language_model.model.layers` -> `model.language_model.layers`), which mergekit's inference names."""
    names = [prefix]
    if prefix.startswith("language_model.model."):
        names.append("model.language_model." + prefix[len("language_model.model.") :])
    elif not prefix.startswith("model."):
        names.append("model." + prefix)
    return tuple(dict.fromkeys(names))


def find_modules(names: Iterable[str], config: dict[str, Any] | None) -> list[ModuleLayout]:
    """The modules of one checkpoint, the text decoder first."""
    names = list(names)
    text = find_layer_stack(names, config)
    if text is None:
        return []
    indices: dict[str, set[int]] = defaultdict(set)
    for n in names:
        m = _LAYER_RE.match(n)
        if m:
            indices[m.group("prefix")].add(int(m.group("index")))
    others = sorted(p for p, idx in indices.items() if p != text.prefix and idx == set(range(len(idx))))
    stacks = [text, *(LayerStack(p, len(indices[p])) for p in others)]
    prefixes = [s.prefix for s in stacks]
    roots = {s.prefix: _root(s.prefix, [p for p in prefixes if p != s.prefix]) for s in stacks}
    loose: dict[str, list[str]] = defaultdict(list)
    projector: list[str] = []
    in_stack = {n for n in names for s in stacks if s.split(n) is not None}
    for n in names:
        if n in in_stack:
            continue
        if any(marker in n for marker in _PROJECTOR_MARKERS):
            projector.append(n)
            continue
        owners = [s.prefix for s in stacks if n.startswith(roots[s.prefix] + ".")]
        owner = max(owners, key=lambda p: len(roots[p])) if owners else text.prefix
        loose[owner].append(n)
    several = len(stacks) > 1 or bool(projector)
    out: list[ModuleLayout] = []
    vision_seen = 0
    for s in stacks:
        if s is text:
            name = "text_decoder" if several else "default"
        elif "vision" in s.prefix or "visual" in s.prefix:
            name = "vision_tower" if vision_seen == 0 else f"vision_tower_{vision_seen}"
            vision_seen += 1
        else:
            name = s.prefix
        out.append(ModuleLayout(name, _stack_aliases(s.prefix), s, tuple(loose[s.prefix]), s is text))
    if projector:
        out.append(ModuleLayout("multi_modal_projector", (), None, tuple(projector), False))
    return out


def _pick(layouts: list[ModuleLayout], name: str) -> ModuleLayout | None:
    return next((m for m in layouts if m.answers_to(name)), None)


class ModulePlanner(Planner):
    """Plans a `modules:` config: each module's tensors from that module's own models, slices and
    parameters; the recipe, parameter and sharding machinery is `Planner`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layouts = {ref: find_modules(ck.tensors, ck.config) for ref, ck in self.ckpts.items()}
        self._text_stacks = dict(self.stacks)
        self._module_depths: dict[str, tuple[int, int]] = {}
        self._check_modules()

    def _check_modules(self) -> None:
        """Every module the config names exists in every model it names (refused here, before any tensor)."""
        assert self.config.modules is not None
        base_layouts = self.layouts[self.base_ref]
        if not base_layouts:
            raise CheckpointError(f"model {self.base_ref!r}: no layer stack found, so no modules to merge")
        known = ", ".join(m.name for m in base_layouts)
        for name, module in self.config.modules.items():
            if name == "default" and len(base_layouts) > 1:
                raise ConfigError(
                    f"{self.source}: `modules.default`: model {self.base_ref!r} has several modules ({known}); "
                    "give each its own entry under `modules`, or merge them all alike with `models:`"
                )
            for ref in dict.fromkeys([self.base_ref, *module.referenced_models()]):
                if _pick(self.layouts[ref], name) is None:
                    mine = ", ".join(m.name for m in self.layouts[ref]) or "none found"
                    raise ConfigError(
                        f"{self.source}: `modules.{name}`: model {ref!r} has no module {name!r} (its modules: {mine})"
                    )
            if module.slices and _pick(base_layouts, name).stack is None:  # type: ignore[union-attr]
                raise ConfigError(
                    f"{self.source}: `modules.{name}.slices`: module {name!r} has no layers to slice; "
                    "give its models under `models`"
                )

    def _module_slices(self, name: str, module: OutputModuleDefinition) -> list[NormalizedSlice]:
        base = self.config.base_model
        if module.slices:
            out = []
            for i, s in enumerate(module.slices):
                for j, src in enumerate(s.sources):
                    stack = self.stacks[src.model]
                    n = stack.count if stack else 0
                    if src.layer_range[1] > n:
                        raise ConfigError(
                            f"{self.source}: `modules.{name}.slices[{i}].sources[{j}].layer_range`: "
                            f"[{src.layer_range[0]}, {src.layer_range[1]}) is past the {n} layers of module "
                            f"{name!r} of model {src.model!r}"
                        )
                sources = tuple(SourceRange(src.model, *src.layer_range, src.parameters) for src in s.sources)
                out.append(NormalizedSlice(sources, s.base_model or base, s.parameters, module.parameters))
            return out
        assert module.models
        counts = {m.model: (self.stacks[m.model].count if self.stacks[m.model] else 0) for m in module.models}
        if len(set(counts.values())) > 1:
            detail = ", ".join(f"{m} has {n}" for m, n in counts.items())
            raise ConfigError(
                f"{self.source}: `modules.{name}.models`: the models' {name} modules have different numbers of "
                f"layers ({detail})"
            )
        n = next(iter(counts.values()))
        sources = tuple(SourceRange(m.model, 0, n, m.parameters) for m in module.models)
        return [NormalizedSlice(sources, base, None, module.parameters)]

    def recipes(self) -> tuple[list[TensorRecipe], list[int] | None]:
        assert self.config.modules is not None
        self._vocab_rows = None
        self._truncated.clear()
        base_layouts = self.layouts[self.base_ref]
        named = {_pick(base_layouts, name).name: (name, module) for name, module in self.config.modules.items()}  # type: ignore[union-attr]
        recipes: list[TensorRecipe] = []
        layer_sources: list[int] | None = None
        try:
            for layout in base_layouts:
                if layout.name not in named:
                    warning = (
                        f"{self.source}: `modules`: module {layout.name!r} is not listed, so its tensors are "
                        f"copied from the base model {self.base_ref!r} (mergekit would leave them out)"
                    )
                    if self.options.strict:
                        raise ConfigError(f"{warning} (an error under --strict)")
                    self.warnings.append(warning)
                    recipes.extend(self._copied(layout))
                    continue
                name, module = named[layout.name]
                self.stacks = {ref: getattr(_pick(self.layouts[ref], name), "stack", None) for ref in self.ckpts}
                built, sources = self._module_recipes(layout, self._module_slices(name, module))
                recipes.extend(built)
                if layout.is_text and module.slices:
                    layer_sources = sources
                elif not layout.is_text and layout.stack is not None and len(sources) != layout.stack.count:
                    self._module_depths[layout.name] = (layout.stack.count, len(sources))
        finally:
            self.stacks = self._text_stacks
        return recipes, layer_sources

    def _copied(self, layout: ModuleLayout) -> list[TensorRecipe]:
        names = [n for n in self.base.tensors if n in layout.loose or (layout.stack and layout.stack.split(n))]
        out = []
        for n in names:
            info = self.base.info(n)
            dtype = self.out_dtype if is_float(info.dtype) else info.dtype
            out.append(TensorRecipe(n, tuple(info.shape), dtype, "copy", (InputRef(self.base_ref, n),)))
        return out

    def _module_recipes(
        self, layout: ModuleLayout, slices: list[NormalizedSlice]
    ) -> tuple[list[TensorRecipe], list[int]]:
        """One module's tensors: its loose ones before (embeddings) and after its layers, from the first
        and last slice's models, and its layers slice by slice (as `Planner.recipes` does for a model)."""
        loose = list(layout.loose)
        if layout.is_text and ties_embeddings(self.base.config, self.base.tensors):
            loose = [n for n in loose if n not in LM_HEAD_NAMES]
        pre = [n for n in loose if is_embedding(n)]
        post = [n for n in loose if not is_embedding(n)]
        first, last = slices[0], slices[-1]
        recipes = [self._recipe(n, n, first, list(first.sources), None, None, 0.0) for n in pre]
        sources: list[int] = []
        out_stack = layout.stack
        if out_stack is not None:
            out_layers = sum(sl.length for sl in slices)  # this module's output depth (a tower has its own)
            for sl in slices:
                lead = sl.sources[0]
                lead_stack = self.stacks[lead.model]
                assert lead_stack is not None
                for i in range(sl.length):
                    t = 1.0 if sl.length == 1 else i / (sl.length - 1)
                    src_layer = lead.start + i
                    rests = [
                        hit[1]
                        for n in self.ckpts[lead.model].tensors
                        if (hit := lead_stack.split(n)) is not None and hit[0] == src_layer
                    ]
                    for rest in rests:
                        recipes.append(
                            self._recipe(
                                out_stack.name(len(sources), rest),
                                lead_stack.name(src_layer, rest),
                                sl,
                                list(sl.sources),
                                i,
                                rest,
                                t,
                                depth=(len(sources), out_layers),
                            )
                        )
                    sources.append(src_layer)
        recipes += [self._recipe(n, n, last, list(last.sources), None, None, 0.0) for n in post]
        return recipes, sources

    def build(self) -> Plan:
        plan = super().build()
        for name, (old, new) in self._module_depths.items():
            if not _set_module_depth(plan.output_config, old, new):
                raise ConfigError(
                    f"{self.source}: `modules.{name}`: its slices give {new} layers where the model has {old}, "
                    "and its config.json has no layer count to rewrite for it"
                )
        return plan


def _set_module_depth(config: dict[str, Any], old: int, new: int) -> bool:
    """Rewrite a vision tower's layer count (`vision_config.num_hidden_layers` or `.depth`) from `old` to `new`."""
    for key, sub in config.items():
        if isinstance(sub, dict) and "vision" in key:
            for depth_key in _DEPTH_KEYS:
                if sub.get(depth_key) == old:
                    sub[depth_key] = new
                    return True
    return False
