"""The documented Python API behind `import mergesmith`: the commands as functions.

Each function takes the command's options as keyword arguments with the command's names and defaults.
Those come from the options model (options/, which the command line is generated from too:
`command_options`), so the API cannot drift from the CLI, and the values go through the same conversion
(`options.to_merge_options`: sizes like "8GB", devices, the Ray checks), so a bad value is the same
ConfigError the command prints; docs/options.md lists every command's options. Resume is the command's:
the same output directory, config and options continue an interrupted merge, whichever of the two
started it.

The library prints nothing unless asked: `progress=True` shows a display fit for the place
(display/notebook.py), a callable gets every ProgressEvent; warnings go to the `mergesmith` logger
(silent unless the program configures logging) and stay on the result's plan.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .engine.run import MergeResult
    from .lora.extract import ExtractResult
    from .multi.stages import StageResult

log = logging.getLogger("mergesmith")
if not log.handlers:  # a library prints nothing unless the program configures logging (else lastResort would)
    log.addHandler(logging.NullHandler())


def command_options(name: str, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """{option name: default} of the command `name` (e.g. "merge"), as Python keyword names (options/)."""
    from .options import api_defaults

    return api_defaults(name, exclude)


def _resolve(function: str, command: str, given: dict[str, Any]) -> dict[str, Any]:
    """The command's defaults updated with `given`; an unknown name is a TypeError (as for any Python
    function), a value the command would refuse is its ConfigError naming the option."""
    from .options import api_values

    resolved = api_values(function, command, given)
    if "transformers_cache" in resolved:  # the command line sets these as it parses them (families.Hub)
        from .io import hub

        cache = resolved["transformers_cache"]
        hub.configure(cache_dir=Path(cache) if cache is not None else None, offline=bool(resolved.get("offline")))
    return resolved


def _merge_options(kw: dict[str, Any], command: str = "merge") -> Any:
    """The command's MergeOptions; notes about mergekit flags without effect go to the logger, as warnings do."""
    from .options import to_merge_options

    return to_merge_options(kw, command, echo=lambda line: log.info("%s", line))


def _controls(kw: dict[str, Any], display: Any, on_plan: Any, stop: threading.Event | None) -> Any:
    """The RunControls of an API run: the output options' values, the display's callbacks and `stop`."""
    from .options import to_run_controls

    return to_run_controls(kw, on_plan=on_plan, on_progress=display.update, stop=stop)


def as_merge_config(config: Any, what: str = "merge") -> tuple[Any, str]:
    """(MergeConfiguration, source name) from a path, a YAML string, a dict or a MergeConfiguration."""
    from .config import MergeConfiguration, load_config, parse_config

    if isinstance(config, MergeConfiguration):
        return config, "config"
    data, source = _config_data(config)
    if data is None:
        if _is_moe_file(source) and what == "merge":
            raise ConfigError(f"{source}: this is a mergekit-moe config (it has `experts`); use mergesmith.moe")
        return load_config(source), source
    from .moe.config import looks_like_moe

    if looks_like_moe(data) and what == "merge":
        raise ConfigError(f"{source}: this is a mergekit-moe config (it has `experts`); use mergesmith.moe")
    return parse_config(data, source), source


def _is_moe_file(path: str) -> bool:
    from .moe.config import is_moe_config_file

    return is_moe_config_file(path)


def _config_data(config: Any) -> tuple[Any, str]:
    """(parsed data, "config") for a dict or YAML text; (None, path) for a file to load."""
    if isinstance(config, dict):
        return config, "config"
    if isinstance(config, Path):
        return None, str(config)
    if not isinstance(config, str):
        raise ConfigError(
            f"config: expected a path, a YAML string, a dict or a MergeConfiguration, got {type(config).__name__}"
        )
    if "\n" not in config and not config.lstrip().startswith("{") and ":" not in config.split("/")[-1]:
        return None, config  # a file name (a missing one is the loader's one-line error)
    if "\n" not in config and Path(config).is_file():
        return None, config
    import yaml

    try:
        data = yaml.safe_load(config)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"config: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {config!r} is neither a file nor a YAML mapping")
    return data, "config"


@dataclass
class PlanReport:
    """What `mergesmith.plan` found: the Plan (data), the report the CLI prints (`report`, also as
    `str(report)`), and the memory this process may use (`memory`)."""

    plan: Any
    report: dict[str, Any]

    @property
    def text(self) -> str:
        from .engine.downloads import render_downloads
        from .engine.report import render_plan_text

        if self.plan is None:  # hub models to download before their tensors can be listed
            return render_downloads(self.report["downloads"])
        text = render_plan_text(self.report)
        return text + "\n" + render_downloads(self.report["downloads"]) if self.report.get("downloads") else text

    @property
    def warnings(self) -> list[str]:
        return list(self.report.get("warnings") or [])

    @property
    def memory(self) -> dict[str, Any] | None:
        return self.report.get("memory")

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython shows the text
        printer.text(self.text)


def plan(config: Any, out_dir: str | Path | None = None, **options: Any) -> PlanReport:
    """Plan a merge (or an MoE assembly) from headers alone: what it writes, its memory and disk needs.

    `options`: those of `mergesmith plan` (`threads`, `max_memory`, `out_shard_size`, ...). With
    `out_dir`, the disk there is checked and probed as the command does. Nothing is written. Hub models not in
    the cache are planned from the Hub's metadata (config, tokenizer, safetensors headers) and `report["downloads"]`
    lists the bytes to fetch (per model, in total) and the free space they need; `plan` is None only when a
    model's tensors cannot be listed before it is downloaded (`.bin` weights).
    """
    from .engine.downloads import plan_before_download
    from .engine.report import check_plan_out_dir, plan_report

    kw = _resolve("plan", "plan", options)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        check_plan_out_dir(out)
    merge_options = _merge_options(kw, "plan")
    moe_config = _maybe_moe(config)
    cfg, source = (moe_config, "config") if moe_config is not None else as_merge_config(config, what="plan")

    def build() -> Any:
        if moe_config is not None:
            from .moe import build_moe_plan

            built, checkpoints, _gates = build_moe_plan(moe_config, merge_options, out)
            return built, checkpoints
        from .engine.run import build_plan

        return build_plan(cfg, merge_options, out, source=source)

    the_plan, checkpoints, downloads = plan_before_download(cfg.referenced_models(), build, out)
    if the_plan is None:  # a model's tensors cannot be listed before it is downloaded: the downloads alone
        return PlanReport(None, {"downloads": downloads})
    return PlanReport(the_plan, plan_report(the_plan, checkpoints, out, merge_options, downloads))


def _maybe_moe(config: Any, allow_all_same: bool = False) -> Any:
    """A MoEConfiguration when `config` is a mergekit-moe config, else None."""
    from .config import MergeConfiguration
    from .moe.config import MoEConfiguration, load_moe_config, looks_like_moe, parse_moe_config

    if isinstance(config, MoEConfiguration):
        return config
    if isinstance(config, MergeConfiguration):
        return None
    data, source = _config_data(config)
    if data is None:
        return load_moe_config(source, allow_all_same=allow_all_same) if _is_moe_file(source) else None
    return parse_moe_config(data, source, allow_all_same=allow_all_same) if looks_like_moe(data) else None


def _warn(warning: str, shown: bool) -> None:
    """A warning goes to the `mergesmith` logger, and is printed too where the caller asked to be shown
    what happens (progress=True; `quiet` hides the progress display only)."""
    log.warning("%s", warning)
    if shown:
        print(f"warning: {warning}")


def _show_warnings(display: Any, shown: bool) -> Callable[[Any], None]:
    def on_plan(the_plan: Any) -> None:
        for warning in the_plan.warnings:
            _warn(warning, shown)
        display.start(the_plan)

    return on_plan


def merge(
    config: Any,
    out_dir: str | Path,
    *,
    progress: bool | Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> MergeResult:
    """Merge the models of `config` into `out_dir`; call it again to resume an interrupted merge.

    `config`: a path, a YAML string, a dict or a MergeConfiguration. `options`: those of `mergesmith
    merge`, same names and defaults (`threads`, `max_memory="8GB"`, `out_shard_size`, `random_seed`,
    `device`, `overwrite`, `force`, `verify`, ...). `progress`: True for a display (a live bar in a
    notebook), a callable for every ProgressEvent; `stop`: an Event another thread may set to stop after
    the tensors in flight (MergeInterrupted). A KeyboardInterrupt (a notebook's stop button, or raised by
    the progress callable) also stops after the tensors in flight, journals them and propagates; the
    next call resumes. Returns a MergeResult (`out_dir`, `plan`, `already_complete`, `seconds`, and for a
    resumed run `tensors_reused`, `shards_reused` and `resume_line()`; `resumed` says whether it was one).
    Errors are the CLI's: ConfigError, CheckpointError, OutputError, MemoryShortage, ...
    """
    from .engine.run import run_merge

    kw = _resolve("merge", "merge", options)
    cfg, source = as_merge_config(config)
    merge_options = _merge_options(kw, "merge")
    return _displayed(
        progress,
        kw,
        out_dir,
        lambda display, shown: _run_with_source(
            run_merge,
            cfg,
            source,
            out_dir,
            merge_options,
            controls=_controls(kw, display, _show_warnings(display, shown), stop),
        ),
    )


def _displayed(
    progress: bool | Callable[[Any], None] | None,
    kw: dict[str, Any],
    out_dir: str | Path,
    run: Callable[[Any, bool], MergeResult],
) -> MergeResult:
    """Run `run(display, shown)` under the display `progress` asks for (none when `quiet`); with progress=True
    the warnings print and the last line says where the model is, as the command's do (with `quiet` too)."""
    from .display.notebook import choose_display
    from .io import hub

    shown = progress is True
    display = choose_display(progress if not kw["quiet"] else None)
    before = (hub.SETTINGS.progress_bars, hub.SETTINGS.report)
    if shown:  # hub models downloaded first: a line per model (and file, off a terminal), as the command shows
        hub.configure(progress_bars=hub.stderr_is_terminal(), report=lambda line: print(line, file=sys.stderr))
    try:
        with display:
            result = run(display, shown)
    finally:
        hub.configure(progress_bars=before[0], report=before[1])
    _report(Path(out_dir), result, shown)
    return result


def _report(out_dir: Path, result: MergeResult, shown: bool, prefix: str = "") -> None:
    """The end of a run: warnings found while merging (NaN/inf in inputs or outputs) and a resume go to the
    `mergesmith` logger always, and with progress=True (`quiet` too: it hides the bar only) the warnings and
    the command's closing lines are printed (`resumed: 8 of 75 tensors already written`, where the model is)."""
    from .display.notebook import result_lines

    for warning in result.warnings:
        _warn(warning, shown)
    resumed = result.resume_line()
    if resumed is not None:
        log.info("%s%s", prefix, resumed)
    if shown:
        for line in result_lines(out_dir, result, prefix):
            print(line)


def _run_with_source(run: Callable[..., Any], cfg: Any, source: str, *args: Any, **kw: Any) -> Any:
    """Run a merge of a parsed config whose messages name `source` (its path, when it came from one)."""
    if source == "config":
        return run(cfg, *args, **kw)
    return run(source, *args, **kw)


def merge_raw(
    config: Any,
    out_dir: str | Path,
    *,
    progress: bool | Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> MergeResult:
    """`mergesmith merge-raw` as a function: merge bare state-dict files (no config.json) into `out_dir`."""
    from .raw.merge import run_raw_merge

    kw = _resolve("merge_raw", "merge-raw", options)
    if kw["tensor_union"] and kw["tensor_intersection"]:
        raise ConfigError("give tensor_union or tensor_intersection, not both")
    cfg, source = as_merge_config(config)
    merge_options = _merge_options(kw, "merge-raw")
    tensor_set = "union" if kw["tensor_union"] else "intersection" if kw["tensor_intersection"] else "exact"
    return _displayed(
        progress,
        kw,
        out_dir,
        lambda display, shown: _run_with_source(
            run_raw_merge,
            cfg,
            source,
            out_dir,
            merge_options,
            tensor_set=tensor_set,
            controls=_controls(kw, display, _show_warnings(display, shown), stop),
        ),
    )


def moe(
    config: Any,
    out_dir: str | Path,
    *,
    progress: bool | Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> MergeResult:
    """`mergesmith moe` as a function: assemble a mixture of experts (a mergekit-moe config as a path,
    YAML string, dict or MoEConfiguration) into `out_dir`; call again to resume."""
    from .moe import run_moe

    kw = _resolve("moe", "moe", options)
    cfg = _maybe_moe(config, allow_all_same=kw["allow_all_same"])
    if cfg is None:
        raise ConfigError("config: not a mergekit-moe config (it has no `experts`); use mergesmith.merge")
    merge_options = _merge_options(kw, "moe")
    return _displayed(
        progress,
        kw,
        out_dir,
        lambda display, shown: run_moe(
            cfg,
            out_dir,
            merge_options,
            controls=_controls(kw, display, display.start, stop),
            allow_all_same=kw["allow_all_same"],
            on_warning=lambda message: _warn(message, shown),
        ),
    )


def multi(
    config: str | Path,
    out_dir: str | Path,
    *,
    progress: bool | Callable[[Any], None] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> list[StageResult]:
    """`mergesmith multi` as a function: run a multi-stage file (a path, or its YAML text) with each named
    stage written to `out_dir/<name>`; returns one StageResult per stage (`name`, `out_dir`, `result`)."""
    from .display.notebook import choose_display
    from .display.terminal import StageProgress
    from .multi.stages import run_multi

    kw = _resolve("multi", "multi", options)
    merge_options = _merge_options(kw, "multi")
    shown = progress is True
    display = StageProgress(lambda: choose_display(progress if not kw["quiet"] else None))  # a display per stage
    with display, tempfile.TemporaryDirectory(prefix="mergesmith-multi-") as scratch:
        path = Path(config) if isinstance(config, Path) or "\n" not in str(config) else None
        if path is None:
            path = Path(scratch) / "multi.yml"
            path.write_text(str(config))
        results = run_multi(
            path,
            out_dir,
            merge_options,
            out_path=kw["out_path"],
            lazy=kw["lazy"],
            controls=_controls(kw, display, _show_warnings(display, shown), stop),
        )
    for r in results:  # per stage, as `mergesmith multi` reports them
        _report(r.out_dir, r.result, shown, prefix=f"{r.name or '(final)'}: ")
    return results


def extract_lora(model: str, base: str, out: str | Path, **options: Any) -> ExtractResult:
    """`mergesmith extract-lora` as a function: write a PEFT LoRA adapter approximating `model - base`
    into `out` (`max_rank=128`, `sv_epsilon`, `embed_lora`, `device`, `overwrite`). Returns an
    ExtractResult (`out_dir`, `ranks`, `modules_to_save`, `seconds`, `notes`)."""
    from .lora.extract import extract_lora as run_extract
    from .options.convert import to_extract_arguments

    kw = _resolve("extract_lora", "extract-lora", options)
    arguments = to_extract_arguments(kw, "device", echo=lambda line: log.info("%s", line))
    return run_extract(str(model), str(base), out, **arguments)
