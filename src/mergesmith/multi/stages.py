"""Multi-stage merges (mergekit-multi's format): several merge documents in one YAML file.

Documents are separated by `---`. Each is an ordinary merge config plus a `name`; a later document
may name an earlier one's output wherever it names a model (`models[].model`, `base_model`, slice
sources, `tokenizer_source`). Named stages are written to `<out-dir>/<name>`; at most one document
may be unnamed, the final merge, written to `--out-path`.

Everything that can be checked before any tensor moves is checked first: document syntax, duplicate
or unsafe names, references that are neither a stage nor an existing model, the headers of every
input that is not a stage, and dependency cycles. An error met while a stage runs names the stage.
Stages then run one at a time in dependency order (ties keep file order). A stage whose plan
fingerprint matches a complete output is skipped without touching its files; since a fingerprint
covers its inputs' identities (size, mtime, header hash), a stage downstream of one that reran is
rerun too, and one downstream of skipped stages is skipped: editing the last stage reruns only it.
A stage directory holding an older mergesmith merge is replaced; any other non-empty directory is
left alone unless `overwrite` is given. A stage directory is mergesmith's to descend into, so a link
in its place is refused (safe_fs.LinkError) rather than followed: replacing the merge it held would
delete files wherever the link points.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import parse_config, read_yaml
from ..engine.planning.shared import MergeOptions
from ..engine.run import MergeResult, RunControls, build_plan, execute_plan
from ..errors import CheckpointError, ConfigError, MergesmithError
from ..io import safe_fs
from ..io.checkpoint import resolve_model_path
from ..io.journal import Journal
from ..io.references import open_checkpoint

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Stage:
    """One merge document: its name (None for the final unnamed merge) and its stage dependencies."""

    name: str | None
    document: dict[str, Any]
    position: int  # 1-based document number, for messages
    depends_on: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"stage {self.name!r}" if self.name else f"document {self.position} (the unnamed final merge)"


@dataclass
class StageResult:
    """What happened to one stage: where it went and whether it ran or was already complete."""

    name: str | None
    out_dir: Path
    ran: bool
    result: MergeResult


def _model_slots(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every (mapping, key) of a merge document whose value names a model (see `_slot_ref`)."""
    if isinstance(doc.get("base_model"), str):
        yield doc, "base_model"
    modules = doc.get("modules")
    holders = [doc, *(m for m in (modules.values() if isinstance(modules, dict) else []) if isinstance(m, dict))]
    for holder in holders:
        yield from _group_slots(holder)
    if isinstance(doc.get("tokenizer_source"), str) and doc["tokenizer_source"] not in ("base", "union"):
        yield doc, "tokenizer_source"
    tokenizer = doc.get("tokenizer")
    if isinstance(tokenizer, dict) and isinstance(tokenizer.get("source"), str):
        if tokenizer["source"] not in ("base", "union"):
            yield tokenizer, "source"


def _group_slots(holder: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """The model slots of `models` and `slices` in a document or one of its modules."""
    for entry in holder.get("models") or []:
        if isinstance(entry, dict) and isinstance(entry.get("model"), str):
            yield entry, "model"
    for sl in holder.get("slices") or []:
        if not isinstance(sl, dict):
            continue
        if isinstance(sl.get("base_model"), str):
            yield sl, "base_model"
        for src in sl.get("sources") or []:
            if isinstance(src, dict) and isinstance(src.get("model"), str):
                yield src, "model"


_TOKENIZER_KEYS = ("tokenizer_source", "source")
_MODEL_PREFIX = "model:"  # mergekit's spelling of a tokenizer source that is a model: `model:<ref>`


def _slot_ref(key: str, value: str) -> tuple[str, str]:
    """(prefix, model reference) of a slot's value: a tokenizer source may be spelled `model:<ref>`,
    and the prefix must come back when the reference is replaced by a stage's output directory."""
    if key in _TOKENIZER_KEYS and value.startswith(_MODEL_PREFIX):
        return _MODEL_PREFIX, value[len(_MODEL_PREFIX) :]
    return "", value


def _resolvable(ref: str) -> bool:
    """A local path or hub id (downloaded here when not cached), or `model+lora` whose two parts are."""
    try:
        resolve_model_path(ref)
        return True
    except CheckpointError:
        pass
    if "+" in ref:
        from ..io.lora_adapter import split_lora_ref

        try:
            resolve_model_path(split_lora_ref(ref)[0])
            return True
        except CheckpointError:
            return False
    return False


def _check_input(source: Path, stage: Stage, ref: str, checked: set[str]) -> None:
    """Open (and validate the headers of) an input that is not a stage, before any stage runs: a bad
    file in the last stage must not be found only after the first stages wrote their outputs."""
    if ref in checked:
        return
    checked.add(ref)
    try:
        open_checkpoint(ref).close()
    except CheckpointError as exc:
        raise CheckpointError(f"{source}: {stage.label}: {exc}") from None


def load_stages(path: str | Path, *, strict: bool = False) -> list[Stage]:
    """Parse and validate every document of a multi-stage file, in file order (`strict`: a config warning
    in any document is an error, before any stage runs)."""
    path = Path(path)
    loaded, text = read_yaml(path, all_documents=True)
    documents = [d for d in loaded if d is not None]
    if not documents:
        raise ConfigError(f"{path}: no merge documents found")

    stages: list[Stage] = []
    for position, doc in enumerate(documents, start=1):
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: document {position}: expected a mapping of keys, got {type(doc).__name__}")
        doc = dict(doc)
        name = doc.pop("name", None)
        if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
            raise ConfigError(
                f"{path}: document {position}: `name` {name!r} must be a plain directory name "
                "(letters, digits, '.', '_', '-'; not starting with '.' or '-')"
            )
        stage = Stage(name, doc, position)
        parse_config(doc, f"{path} ({stage.label})", strict=strict)  # each document is an ordinary merge config
        stages.append(stage)

    seen: dict[str, int] = {}
    for stage in stages:
        if stage.name is None:
            continue
        if stage.name in seen:
            raise ConfigError(
                f"{path}: documents {seen[stage.name]} and {stage.position} are both named {stage.name!r}"
            )
        seen[stage.name] = stage.position
    unnamed = [s.position for s in stages if s.name is None]
    if len(unnamed) > 1:
        raise ConfigError(
            f"{path}: documents {', '.join(map(str, unnamed))} have no `name`; only the final merge may be unnamed"
        )

    checked: set[str] = set()
    for stage in stages:
        for holder, key in _model_slots(stage.document):
            _prefix, ref = _slot_ref(key, holder[key])
            if ref in seen:
                if ref == stage.name:
                    raise ConfigError(f"{path}: {stage.label} names itself as a model")
                if ref not in stage.depends_on:
                    stage.depends_on.append(ref)
            elif not _resolvable(ref):
                hint = difflib.get_close_matches(ref, list(seen), n=1)
                suggestion = f" (did you mean stage `{hint[0]}`?)" if hint else ""
                raise ConfigError(
                    f"{path}: {stage.label}: model {ref!r} is neither a stage of this file nor a local path or "
                    f"cached model{suggestion}"
                )
            elif key not in _TOKENIZER_KEYS:  # a tokenizer source need not hold weights
                _check_input(path, stage, ref, checked)
    return stages


def stage_order(stages: list[Stage], source: str = "config") -> list[Stage]:
    """Dependencies first, otherwise file order; a cycle is an error that names its stages."""
    by_name = {s.name: s for s in stages if s.name is not None}
    state: dict[int, str] = {}  # position -> "visiting" | "done"
    ordered: list[Stage] = []

    def visit(stage: Stage, trail: list[str]) -> None:
        mark = state.get(stage.position)
        if mark == "done":
            return
        if mark == "visiting":
            cycle = trail[trail.index(stage.name or "") :] + [stage.name or ""]
            raise ConfigError(f"{source}: stages depend on each other in a cycle: {' -> '.join(cycle)}")
        state[stage.position] = "visiting"
        for dep in stage.depends_on:
            visit(by_name[dep], [*trail, stage.name or "(final)"])
        state[stage.position] = "done"
        ordered.append(stage)

    for stage in stages:
        visit(stage, [])
    return ordered


def _resolved_document(stage: Stage, outputs: dict[str, Path]) -> dict[str, Any]:
    """The stage's document with every stage name replaced by that stage's output directory."""
    doc = copy.deepcopy(stage.document)
    for holder, key in _model_slots(doc):
        prefix, ref = _slot_ref(key, holder[key])
        if ref in outputs:
            holder[key] = prefix + str(outputs[ref])
    return doc


def _check_out_path(source: str, out_path: Path, outputs: dict[str, Path], has_final: bool) -> None:
    """--out-path is for the unnamed final merge, and must not be (or be inside) a stage's directory:
    the final merge would replace that stage's files, and every rerun would rewrite both."""
    if not has_final:
        raise ConfigError(
            f"{source}: --out-path {out_path} is given but every document has a `name` (each goes to its "
            "stage directory); drop --out-path, or drop the `name` of the final merge"
        )
    final = out_path.resolve()
    for name, stage_dir in outputs.items():
        resolved = stage_dir.resolve()
        if final == resolved or resolved in final.parents:
            raise ConfigError(
                f"{source}: --out-path {out_path} is {'' if final == resolved else 'inside '}the directory of "
                f"stage {name!r} ({stage_dir}); write the final merge somewhere else"
            )


@contextmanager
def _labelled(stage: Stage) -> Iterator[None]:
    """Prefix a stage's one-line errors with its label: which of several merges failed matters."""
    try:
        yield
    except MergesmithError as exc:
        message = str(exc)
        if stage.label not in message:
            exc.args = (f"{stage.label}: {message}", *exc.args[1:])
        raise


def run_multi(
    config_path: str | Path,
    out_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    out_path: str | Path | None = None,
    lazy: bool = True,
    controls: RunControls = RunControls(),
    on_stage: Callable[[Stage, Path], None] | None = None,
) -> list[StageResult]:
    """Run every stage of a multi-stage file in dependency order; returns one result per stage, in run order.

    `lazy=False` reruns stages even when their output is complete (mergekit-multi's `--no-lazy`);
    `controls.verify` checksums a complete stage's shards before skipping it (see `engine.run.execute_plan`);
    `controls.overwrite` lets a stage replace model files mergesmith did not write.
    """
    source = str(config_path)
    stages = load_stages(config_path, strict=bool(options and options.strict))
    ordered = stage_order(stages, source)
    root = Path(out_dir)
    if any(s.name is None for s in stages) and out_path is None:
        raise ConfigError(f"{source}: one document has no `name` (the final merge): give --out-path for its output")
    outputs = {s.name: root / s.name for s in stages if s.name is not None}
    if out_path is not None:
        _check_out_path(source, Path(out_path), outputs, has_final=any(s.name is None for s in stages))
    options = options or MergeOptions()

    results: list[StageResult] = []
    with _one_ray_for_all_stages(options):
        for stage in ordered:
            results.append(
                _run_stage(
                    stage,
                    source,
                    outputs,
                    out_path,
                    options,
                    lazy,
                    controls,
                    on_stage,
                )
            )
    return results


def _one_ray_for_all_stages(options: MergeOptions) -> AbstractContextManager[None]:
    """With `--executor ray`, one local Ray for the whole run instead of one per stage."""
    if options.executor != "ray":
        return nullcontext()
    try:
        from ..engine.execution.ray_executor import shared_local_ray
    except ConfigError:  # Ray is not installed: the first stage that needs it says so
        return nullcontext()
    return shared_local_ray()


def _run_stage(
    stage: Stage,
    source: str,
    outputs: dict[str, Path],
    out_path: str | Path | None,
    options: MergeOptions,
    lazy: bool,
    controls: RunControls,
    on_stage: Callable[[Stage, Path], None] | None,
) -> StageResult:
    """Run (or skip, when complete) one stage into its directory."""
    target = outputs[stage.name] if stage.name is not None else Path(out_path or "")
    if on_stage is not None:
        on_stage(stage, target)
    with _labelled(stage):
        if stage.name is not None and os.path.islink(target):  # <out-dir>/<name> is ours: never a link
            raise safe_fs.LinkError(target)
        where = f"{source} ({stage.label})"
        config = parse_config(_resolved_document(stage, outputs), where, strict=options.strict)
        stage_options = copy.deepcopy(options)  # build_plan may draw a seed: never share it across stages
        plan, checkpoints = build_plan(config, stage_options, target, source=where)
        previous = Journal.load(target) if target.is_dir() else None
        if previous is None:
            replace = controls.overwrite  # not a mergesmith output: only with the user's say-so
        else:
            replace = not lazy or previous.fingerprint != plan.fingerprint()
        stage_controls = dataclasses.replace(controls, overwrite=replace)
        result = execute_plan(plan, checkpoints, target, stage_options, controls=stage_controls)
    return StageResult(stage.name, target, not result.already_complete, result)
