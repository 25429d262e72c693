"""What features add to the engine: recipe operations and vocabulary planning steps, registered by name.

The engine runs `copy` and `merge` recipes and a few assembly ops of its own (execution/ops.py). A feature
above it adds an op (tokenizer/'s `vocab_merge`, tokensurgeon/'s `transplant` and `transplant_merge`), a
step that rewrites a merge plan's vocabulary tensors (the tokenizer step, the transplant step), or a data step
(regmean/'s: inputs computed from the models before the merge, such as Gram matrices of layer inputs) by
registering it here. The engine looks ops and steps up by name and never imports a feature folder.

Why registration happens in the root package. A plan must find every op and step in every process that builds
or runs it: the command line, a test that calls `engine.run.run_merge` directly, a Ray worker unpickling a
task. The one module all of these import first is `mergesmith/__init__.py` (Python runs a package's
`__init__` before any of its submodules), so that is where each feature's registration module is imported
(`tokenizer/registration.py`, `tokensurgeon/registration.py`). Those modules are tiny: names, the configs a
step applies to, and callables that import the feature's real code only when called, so `import mergesmith`
stays as cheap as before (no torch, no transformers, no typing: see tests/test_python_api.py). This module
therefore imports nothing at run time either; the Protocols below are for type checkers.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not `from typing import ...`: the root package imports this module at start-up

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any, Protocol

    import torch

    from ..config import MergeConfiguration
    from ..io.checkpoint import Checkpoint
    from .plan import InputRef, Plan, TensorRecipe
    from .planning.architecture import LayerStack
    from .planning.shared import MergeOptions

    Loader = Callable[[InputRef], torch.Tensor]
    OpFn = Callable[[TensorRecipe, Loader], torch.Tensor]

    class PlanningView(Protocol):
        """What a vocabulary step reads from the merge planner that calls it (planning/merge_planner.py)."""

        config: MergeConfiguration
        options: MergeOptions
        source: str  # where the config came from, for error lines
        ckpts: dict[str, Checkpoint]
        base: Checkpoint
        base_ref: str
        compute_dtype: str
        stacks: dict[str, LayerStack | None]

    class VocabularyPlan(Protocol):
        """What a vocabulary step changes in the plan."""

        recipes: list[TensorRecipe]  # all recipes, the vocabulary tensors' rewritten
        files: list[tuple[str, str]] | None  # tokenizer files to write instead of the copied ones
        vocab_rows: int | None  # the output's vocabulary size, when the step sets it
        warnings: list[str]
        plan_options: dict[str, Any]  # entries for Plan.options (what the report shows, what the fingerprint holds)

        def finish_config(self, config: dict[str, Any]) -> None:
            """Adjust the output config.json (special-token ids) to the new vocabulary."""

    class DataPlan(Protocol):
        """What a data step changes in the plan: recipes that read inputs it makes before the merge."""

        recipes: list[TensorRecipe]  # all recipes, some now reading the step's inputs
        warnings: list[str]
        plan_options: dict[str, Any]  # entries for Plan.options (the report shows them, the fingerprint holds them)
        input_bytes: dict[tuple[str, str], int]  # (model, tensor) of each input the step makes -> its bytes
        # (the merge's disk check counts their sum: the step writes them into the output directory's state)

    class DataStep(Protocol):
        """A step that computes extra merge inputs from the models themselves (running them on data) before the
        merge, inside the output directory's state, journaled so a rerun reuses what was finished."""

        name: str

        def applies(self, config: MergeConfiguration) -> bool:
            """Whether this merge config asks for the step (read from the config alone, no files)."""

        def plan(self, planner: PlanningView, recipes: list[TensorRecipe]) -> DataPlan:
            """Check what the step needs (before any tensor is read) and point recipes at its inputs."""

        def prepare(
            self, plan: Plan, checkpoints: dict[str, Checkpoint], out_dir: Path, stop: threading.Event | None
        ) -> dict[str, Checkpoint]:
            """Make (or reuse) the step's inputs under `out_dir`'s state directory; the checkpoints to read them
            from, by the model names the recipes use."""

        def finish(self, out_dir: Path) -> None:
            """The merge is complete: remove what `prepare` made (nothing reads it again)."""

    class VocabularyStep(Protocol):
        """A planning step that rewrites the embedding and output-head recipes of a merge plan."""

        name: str
        replaces: tuple[str, ...]  # steps this one stands in for when both apply

        def applies(self, config: MergeConfiguration) -> bool:
            """Whether this merge config asks for the step (read from the config alone, no files)."""

        def plan(self, planner: PlanningView, recipes: list[TensorRecipe]) -> VocabularyPlan:
            """The step's plan over the merge planner's `recipes`."""


_OPS: dict[str, OpFn] = {}
_STEPS: dict[str, VocabularyStep] = {}
_DATA_STEPS: dict[str, DataStep] = {}


def register_op(name: str, fn: OpFn) -> OpFn:
    """Make recipe op `name` run `fn(recipe, load)`; a name is registered once (`copy`/`merge` are the engine's)."""
    if name in _OPS or name in ("copy", "merge"):
        raise ValueError(f"recipe op {name!r} registered twice")
    _OPS[name] = fn
    return fn


def recipe_op(name: str) -> OpFn:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown recipe op {name!r}") from None


def register_vocabulary_step(step: VocabularyStep) -> VocabularyStep:
    if step.name in _STEPS:
        raise ValueError(f"vocabulary step {step.name!r} registered twice")
    _STEPS[step.name] = step
    return step


def vocabulary_step(config: MergeConfiguration) -> VocabularyStep | None:
    """The step this config asks for, or None. A step that applies stands in for the steps it `replaces`
    (a `transplant:<donor>` source is a tokenizer source too); two that still both apply are a bug."""
    applying = [step for step in _STEPS.values() if step.applies(config)]
    replaced = {name for step in applying for name in step.replaces}
    left = [step for step in applying if step.name not in replaced]
    if len(left) > 1:
        raise RuntimeError(f"vocabulary steps {', '.join(s.name for s in left)} all apply to one config")
    return left[0] if left else None


def register_data_step(step: DataStep) -> DataStep:
    if step.name in _DATA_STEPS:
        raise ValueError(f"data step {step.name!r} registered twice")
    _DATA_STEPS[step.name] = step
    return step


def data_steps(config: MergeConfiguration) -> list[DataStep]:
    """The data steps this config asks for, in registration order."""
    return [step for step in _DATA_STEPS.values() if step.applies(config)]


def data_step(name: str) -> DataStep:
    """The data step a plan names in its `prepare` option."""
    try:
        return _DATA_STEPS[name]
    except KeyError:
        raise ValueError(f"unknown data step {name!r}") from None
