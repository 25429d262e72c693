"""The merge planner's vocabulary side: models whose embedding rows differ, the tokenizer files the output gets,
and the vocabulary step (a feature's, found in engine/extensions.py) that rewrites the vocabulary tensors.

Kept apart from merge_planner.py, which decides the recipes of every tensor, because none of this changes
which inputs feed a tensor: it refuses or warns about rows matched by position, picks the tokenizer to copy,
and hands the recipes to the step a config asks for (`tokenizer`, `tokenizer_source`, `chat_template`,
`transplant:<donor>`), which the engine knows only by its registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import ConfigError
from ...io.model_files import TOKENIZER_FILES
from ...io.references import tokenizer_root
from ..extensions import vocabulary_step

if TYPE_CHECKING:
    from ...config import MergeConfiguration
    from ...io.checkpoint import Checkpoint
    from ..extensions import VocabularyPlan
    from ..plan import TensorRecipe
    from .shared import MergeOptions


class VocabularyPlanning:
    """A mixin of the merge planner (merge_planner.Planner): what it does about the vocabulary."""

    config: MergeConfiguration
    options: MergeOptions
    ckpts: dict[str, Checkpoint]
    base: Checkpoint
    base_ref: str
    warnings: list[str]
    needs_model_config: bool
    # (per-model row counts, output rows) -> embedding/head tensors cut to the smallest vocabulary (set by the
    # recipes) and the output's vocabulary rows when they differ from the base's
    _truncated: dict[tuple[tuple[tuple[str, int], ...], int], list[str]]
    _vocab_rows: int | None

    def plan_vocabulary(self, recipes: list[TensorRecipe]) -> VocabularyPlan | None:
        """Run the vocabulary step the config asks for over `recipes` (None when it asks for none), after
        refusing vocabularies of different sizes that nothing lines up; warns about rows matched by position."""
        self._refuse_mismatched_vocabularies()
        step = vocabulary_step(self.config)
        result = None
        if step is not None:
            result = step.plan(self, recipes)  # type: ignore[arg-type]  # the planner has what a PlanningView has
            self.warnings.extend(result.warnings)
            if result.vocab_rows is not None:
                self._vocab_rows = result.vocab_rows
        return result

    def files_to_copy(self, tokenizer_files: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
        """Small files for the output; `tokenizer_files` (a built tokenizer) replace the copied ones."""
        files: list[tuple[str, str]] = []
        if tokenizer_files is not None:
            files.extend(tokenizer_files)
        elif self.options.copy_tokenizer:
            tok_ref = self._tokenizer_source()
            tok_root = self.ckpts[tok_ref].root if tok_ref in self.ckpts else tokenizer_root(tok_ref)
            for name in TOKENIZER_FILES:
                if (tok_root / name).is_file():
                    files.append((str(tok_root / name), name))
        gen = self.base.root / "generation_config.json"
        if gen.is_file() and all(name != gen.name for _src, name in files):  # the tokenizer step may rewrite it
            files.append((str(gen), "generation_config.json"))
        return files

    def _refuse_mismatched_vocabularies(self) -> None:
        """mergekit 0.1.5's rule, checked from headers before any tensor is read: vocabularies of different sizes
        are merged only when the config says how to line their tokens up (`tokenizer_source` or a `tokenizer`
        section), or with --unsafe-truncate-embeddings, which keeps the first rows of each, matched by position
        (then a warning says so)."""
        configured = self.config.tokenizer is not None or bool(self.config.tokenizer_source)
        if not self._truncated or configured or self.options.unsafe_truncate_embeddings:
            return
        (counts, rows), names = next(iter(self._truncated.items()))
        sizes = ", ".join(f"model {m!r} has {n}" for m, n in counts)
        fix = (
            "set `tokenizer_source: base` (or `union`) to build the vocabulary and re-index the rows by token, or "
            if self.needs_model_config  # a raw merge (bare state dicts) has no tokenizer to build
            else ""
        )
        raise ConfigError(
            f"{self.source}: vocabulary sizes differ ({names[0]!r}: {sizes} rows); {fix}pass "
            f"--unsafe-truncate-embeddings to keep the first {rows} rows of each, matched by position (right only "
            "when the token ids agree)"
        )

    def _truncation_warnings(self) -> list[str]:
        """One warning per distinct vocabulary mismatch the recipes cut to the smallest vocabulary.

        Rows are matched by position, not by token: a model whose tokenizer has more tokens than the output
        has rows (the base's, which is copied, when it is the larger) would index past the embedding."""
        out = []
        tok_ref = self._tokenizer_source()
        for (counts, rows), names in self._truncated.items():
            sizes = ", ".join(f"model {m!r} has {n}" for m, n in counts)
            tok_rows = dict(counts).get(tok_ref)
            risk = ""
            if self.needs_model_config and self.options.copy_tokenizer and tok_rows is not None and tok_rows > rows:
                risk = (
                    f"; the tokenizer is copied from {tok_ref!r} ({tok_rows} rows), so its token ids from {rows} up "
                    "would index out of range"
                )
            fix = (
                "; set `tokenizer_source: base` or `tokenizer_source: union` to build the vocabulary and re-index "
                "the rows by token"
                if self.needs_model_config  # a raw merge (bare state dicts) has no tokenizer to build
                else ""
            )
            out.append(
                f"vocabulary sizes differ ({', '.join(names)}: {sizes} rows): the output keeps the first {rows} "
                f"rows of each, matched by position, not by token{risk}{fix}"
            )
        return out

    def _tokenizer_source(self) -> str:
        """The model whose tokenizer files are copied when no tokenizer is built (see tokenizer/)."""
        source = self.config.tokenizer_source
        if self.config.tokenizer is not None:
            source = self.config.tokenizer.source
        if source in (None, "base", "union"):
            return self.base_ref
        return source
