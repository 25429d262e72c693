"""The `mergesmith` command line: argument handling and printing, no logic of its own.

A user mistake prints one line (`error: ...`) and exits 2; an unexpected failure prints one line
too and exits 1, with the traceback only under `-v`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from . import mergekit_flags
from .errors import ConfigError, MergesmithError
from .runtime.process_tuning import (
    exit_code_of,
    exit_now,
    freeze_long_lived_objects,
    prefer_huge_pages,
    thaw_objects,
)
from .sizes import human_size

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*$")
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int, option: str) -> int:
    """`5B`/`5G`/`500M`/`8GB` are decimal (5B = 5 billion bytes, as mergekit reads it); `8GiB` binary."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    number, unit, binary, b = m.groups()
    unit = unit.lower()
    if binary and not unit:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    if unit == "" and b:  # "5B" or "5b": billions, mergekit's spelling for shard sizes
        size = int(float(number) * 1e9)
    else:
        size = int(float(number) * (1024 if binary else 1000) ** _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"`{option}`: size must be positive, got {text!r}")
    return size



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergesmith")
def cli() -> None:
    """Merge language-model checkpoints (mergekit configs, streamed, resumable)."""


# What --random-seed, --copy-tokenizer and --write-model-card do in each command that has them (a help text
# says what the option does in THAT command).
_SEED_HELP = {
    "moe": "Seed for gate_mode random and uniform_random router weights (default: drawn and recorded).",
    "tokensurgeon": "Seed for --approximation-method randn and --new-vocab-noise (default: drawn and recorded).",
}
_SEED_HELP_MERGE = "Seed for randomised methods (DARE, DELLA, ...; default: drawn and recorded)."
_TOKENIZER_HELP = {
    "moe": "Copy base_model's tokenizer to OUT_DIR.",
}
_CARD_HELP = {
    "moe": "Write a README.md model card naming the base model, the experts and the gate mode.",
    "tokensurgeon": "Write a README.md model card naming BASE, DONOR and the approximation method.",
}
_STRICT_HELP = {
    "moe": "Treat every warning as an error: an unknown config key, NaN/inf in the inputs, a plan's warnings.",
    "tokensurgeon": "Treat every warning as an error: NaN/inf in the inputs, a plan's warnings.",
}
_STRICT_HELP_MERGE = (
    "Treat every warning as an error: an unknown key or a parameter the method does not use (which mergekit "
    "ignores), a suspicious parameter value, NaN/inf in the inputs, a plan's warnings."
)
_DEVICE_HELP = {
    "moe": "Where the router pass (gate_mode hidden) and the arithmetic run.",
    "tokensurgeon": "Where the approximation of the new rows runs.",
}
# mergekit's merge options that do nothing in a command: declared there by mergekit_flags (with a note)
_OMIT = {
    "merge-raw": ("copy_tokenizer", "write_model_card", "trust_remote_code"),
    "moe": ("allow_crimes",),
    "tokensurgeon": ("copy_tokenizer", "allow_crimes"),
}
_MERGEKIT_NAMES = {
    "merge": "mergekit-yaml",
    "plan": "mergekit-yaml",
    "moe": "mergekit-moe",
    "multi": "mergekit-multi",
    "merge-raw": "mergekit-pytorch",
    "tokensurgeon": "mergekit-tokensurgeon",
    "extract-lora": "mergekit-extract-lora",
    "evolve": "mergekit-evolve",
}


def _merge_options(command: str) -> Callable[[Any], Any]:
    """The options every merging command shares, worded for `command`, then the mergekit flags it accepts
    (mergekit_flags.py)."""
    omit = _OMIT.get(command, ())

    def apply(f: Any) -> Any:
        opts = [
            click.option(
                "--out-shard-size",
                default="5B",
                show_default=True,
                help="Bytes of tensor data per output shard: 5B, 500M, 2G...",
            ),
            click.option("--random-seed", type=int, default=None, help=_SEED_HELP.get(command, _SEED_HELP_MERGE)),
            click.option(
                "--copy-tokenizer/--no-copy-tokenizer",
                "copy_tokenizer",
                default=True,
                show_default=True,
                help=_TOKENIZER_HELP.get(command, "Copy the tokenizer (from the base model or tokenizer_source)."),
            ),
            click.option(
                "--write-model-card/--no-write-model-card",
                "write_model_card",
                default=True,
                show_default=True,
                help=_CARD_HELP.get(command, "Write a README.md model card naming the method and the models merged."),
            ),
            click.option(
                "--allow-crimes/--no-allow-crimes", default=False, help="Merge models of different architectures."
            ),
            click.option(
                "--trust-remote-code/--no-trust-remote-code",
                "trust_remote_code",
                default=False,
                help="Allow model code from checkpoints (off by default).",
            ),
            click.option("--strict", is_flag=True, help=_STRICT_HELP.get(command, _STRICT_HELP_MERGE)),
            click.option(
                "--device",
                type=click.Choice(["cpu", "cuda", "mps", "auto"]),
                default="cpu",
                show_default=True,
                help=_DEVICE_HELP.get(command, "Where the merge arithmetic runs."),
            ),
            click.option("--cuda/--no-cuda", default=False, help="Same as --device cuda."),
            click.option(
                "--threads",
                type=click.IntRange(1, 256),
                default=None,
                help="Worker threads (default: number of cores).",
            ),
            click.option("--max-memory", default=None, help="Bound on bytes in flight, e.g. 8GB."),
            click.option(
                "--executor",
                type=click.Choice(["local", "ray"]),
                default="local",
                show_default=True,
                help="local: a thread pool here; ray: one Ray task per output shard (needs `pip install "
                "mergesmith[ray]` and OUT_DIR and the inputs on a filesystem every node shares).",
            ),
            click.option(
                "--ray-address",
                default=None,
                help="Ray cluster to join (`auto`, `HOST:6379`, `ray://HOST:10001`); default: RAY_ADDRESS or a "
                "local Ray.",
            ),
            click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and details."),
        ]
        names = ("out_shard_size", "random_seed", "copy_tokenizer", "write_model_card", "allow_crimes",
                 "trust_remote_code", "strict", "device", "cuda", "threads", "max_memory", "executor", "ray_address",
                 "verbose")
        f = mergekit_flags.add_flags(command)(f)
        for name, opt in reversed(list(zip(names, opts))):
            if name not in omit:
                f = opt(f)
        return f

    return apply


def _epilog(command: str) -> str | None:
    """The --help epilog naming the mergekit flags `command` accepts without effect."""
    return mergekit_flags.epilog(command, _MERGEKIT_NAMES[command]) or None


def _set_cache(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    from .io import hub

    hub.configure(cache_dir=value)
    return value


def _set_offline(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    from .io import hub

    hub.configure(offline=value)
    return value


def _hub_options(f: Any) -> Any:
    """Where hub models are cached and whether they may be downloaded: options of every command that reads
    models. They set io.hub's process-wide settings as they are parsed, so no command passes them on."""
    f = click.option(
        "--offline",
        is_flag=True,
        expose_value=False,
        callback=_set_offline,
        help="Never download: a hub id must already be in the cache (as HF_HUB_OFFLINE=1).",
    )(f)
    return click.option(
        "--transformers-cache",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=_set_cache,
        help="Where hub models are looked up and downloaded (default: the Hugging Face cache, HF_HUB_CACHE).",
    )(f)


def _options(kw: dict[str, Any], command: str = "merge", echo: Callable[[str], None] | None = None):
    """MergeOptions from a merging command's (or the API's) keyword values, mergekit's flags mapped first; the
    notes about flags without effect go to `echo` (default: stderr) once the options are checked."""
    from .engine.planning.shared import MergeOptions
    from .io.lora_cache import lora_merge_settings

    taken = mergekit_flags.take(command, kw)

    executor = kw.get("executor") or "local"
    if kw.get("ray_address") and executor != "ray":
        raise ConfigError("`--ray-address` only applies to the Ray executor: add `--executor ray`")
    from .runtime.devices import resolve_device

    device = "cuda" if kw.get("cuda") else kw.get("device", "cpu")
    # Ray workers, not this driver, need the device
    device = resolve_device(device, check=executor != "ray", what="--device")
    if executor == "ray":
        from .engine.execution.ray_executor import RayExecutor  # noqa: F401 - fail before planning when Ray is not installed
    options = MergeOptions(
        out_shard_size=parse_size(kw["out_shard_size"], "--out-shard-size"),
        random_seed=kw.get("random_seed"),
        copy_tokenizer=kw.get("copy_tokenizer", True),
        write_model_card=kw.get("write_model_card", True),
        allow_crimes=kw.get("allow_crimes", False),
        trust_remote_code=kw.get("trust_remote_code", False),
        threads=kw.get("threads") or (os.cpu_count() or 1),
        max_memory=parse_size(kw["max_memory"], "--max-memory") if kw.get("max_memory") else None,
        device=device,
        executor=executor,
        ray_address=kw.get("ray_address"),
        strict=bool(kw.get("strict")),
        unsafe_truncate_embeddings=bool(taken.get("unsafe_truncate_embeddings")),
        # `plan` reads headers only: a LoRA input is seen through its adapter there, never merged into the cache
        lora_merge=None
        if command == "plan"
        else lora_merge_settings(taken.get("lora_merge_cache"), taken.get("lora_merge_dtype")),
    )
    taken.say_notes(echo)  # the options are checked: a refused command line printed no note
    return options


class _Interrupts:
    """First Ctrl-C asks the merge to stop after the tensors in flight; a second one exits at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, _signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            _quit_at_once(_signum, _frame)
        self.stop.set()
        click.echo("\nstopping after the tensors in flight (Ctrl-C again to quit at once)...", err=True)

    def __exit__(self, *exc: Any) -> None:
        if self._previous is None:
            return
        if self.stop.is_set():
            # Shutdown after a stop (joining threads, atexit callbacks) can take a while; a Ctrl-C
            # there must quit at once, not print a KeyboardInterrupt traceback from an atexit hook.
            signal.signal(signal.SIGINT, _quit_at_once)
        else:
            signal.signal(signal.SIGINT, self._previous)


def _quit_at_once(_signum: int, _frame: Any) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a half-written line must not keep us from exiting
        pass
    os.write(2, b"\ninterrupted again: quitting at once\n")
    os._exit(130)


def _merge_progress(quiet: bool) -> Any:
    """The live bar on a terminal, plain periodic lines elsewhere, nothing with -q (display/terminal.py)."""
    from .display.terminal import merge_progress

    return merge_progress(quiet)


def _warn_then(start: Any, prefix: str = "") -> Any:
    """An `on_plan` callback that prints the plan's warnings on stderr (with -q too: it hides progress only),
    then calls `start`."""

    def on_plan(plan: Any) -> None:
        freeze_long_lived_objects()  # the plan is built: what is alive now lives until the end
        for warning in plan.warnings:
            click.echo(f"{prefix}warning: {warning}", err=True)
        start(plan)

    return on_plan


_verify_option = click.option(
    "--verify",
    is_flag=True,
    help="Checksum every shard of a complete output instead of trusting its unchanged size and mtime.",
)


def _output_options(
    overwrite_help: str = "Replace a different merge already in OUT_DIR.", verify: bool = True
) -> Callable[[Any], Any]:
    """The options of every command that writes a model into OUT_DIR: --overwrite, --force, --quiet and
    (where a rerun may trust a complete output) --verify, in that order in --help."""

    def apply(command: Any) -> Any:
        if verify:
            command = _verify_option(command)
        command = click.option(
            "--quiet/--no-quiet", "-q", "quiet", default=False,
            help="No progress display (warnings and errors still print).",
        )(command)
        command = click.option("--force", is_flag=True, help="Start even if the disk looks too small.")(command)
        return click.option("--overwrite", is_flag=True, help=overwrite_help)(command)

    return apply


def _run_shown(run: Callable[..., Any], quiet: bool, *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)` under the progress display (none with -q) and Ctrl-C handling every command that
    writes a model uses: the plan's warnings first, then the bar; an interrupt stops at a resumable point."""
    with _Interrupts() as interrupts, _merge_progress(quiet) as progress:
        on_plan = _warn_then(progress.start)
        return run(*args, on_plan=on_plan, on_progress=progress.update, stop=interrupts.stop, **kwargs)


@cli.command(short_help="Merge a mergekit config into OUT_DIR (resumable).", epilog=_epilog("merge"))
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_merge_options("merge")
@_output_options()
def merge(config_file: Path, out_dir: Path, overwrite: bool, force: bool, quiet: bool, verify: bool, **kw: Any) -> None:
    """Merge the models of CONFIG_FILE into OUT_DIR (rerun to resume an interrupted merge)."""
    from .runtime import import_manifest
    from .runtime.warm_start import read_ahead_inputs

    import_manifest.read_ahead()  # the files the imports below will read, as the last merge recorded them
    read_ahead_inputs(config_file, out_dir)  # before the heavy imports below
    from .engine.run import run_merge
    from .moe.config import is_moe_config_file

    if is_moe_config_file(config_file):
        raise ConfigError(f"{config_file}: this is a mergekit-moe config (it has `experts`); use `mergesmith moe`")
    options = _options(kw, "merge")
    result = _run_shown(
        run_merge, quiet, config_file, out_dir, options, overwrite=overwrite, force=force, verify=verify
    )
    import_manifest.record()  # for the next merge's start
    _report_result(out_dir, result)


@cli.command("plan", short_help="Show what a merge will do and cost, from headers.", epilog=_epilog("plan"))
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path), required=False)
@_hub_options
@_merge_options("plan")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--tensors/--no-tensors", default=False, help="List every output tensor.")
def plan_cmd(config_file: Path, out_dir: Path | None, as_json: bool, tensors: bool, **kw: Any) -> None:
    """Show what a merge will do and cost, reading headers only (no tensor data).

    A mergekit-moe config (one with `experts` and no `merge_method`) is planned as an MoE assembly;
    its router weights are not computed here.
    """
    from .engine.downloads import plan_before_download, render_downloads
    from .engine.report import check_plan_out_dir, plan_report, render_plan_text
    from .engine.run import build_plan
    from .moe.config import is_moe_config_file

    if out_dir is not None:
        check_plan_out_dir(out_dir)
    options = _options(kw, "plan")
    moe_file = is_moe_config_file(config_file)

    def build() -> Any:
        if moe_file:
            from .moe import build_moe_plan

            plan, checkpoints, _gates = build_moe_plan(config_file, options, out_dir)
            return plan, checkpoints
        return build_plan(config_file, options, out_dir)

    plan, checkpoints, downloads = plan_before_download(_config_refs(config_file, options), build, out_dir)
    if plan is None:  # a model's tensors cannot be listed before it is downloaded: the downloads alone
        click.echo(json.dumps({"downloads": downloads}, indent=2) if as_json else render_downloads(downloads))
        return
    report = plan_report(plan, checkpoints, out_dir, options)
    if downloads:
        report["downloads"] = downloads
    moe = plan.options.get("moe")
    if moe:
        report["method"] = "moe"
        report["moe"] = moe
    transplant = plan.options.get("tokensurgeon")  # `tokenizer_source: transplant:<donor>`
    if transplant:
        report["tokensurgeon"] = transplant
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_plan_text(report, show_tensors=tensors))
        if transplant:
            from .tokensurgeon.planner import describe_counts

            click.echo(
                f"tokenizer: transplant:{transplant['donor']} (the donor's {transplant['vocab_size']} tokens; "
                f"{describe_counts(transplant['tensors'])}; approximated by OMP)"
            )
        if moe:
            click.echo(
                f"moe: {moe['architecture']}, {moe['experts']} experts, {moe['experts_per_token']} per token, "
                f"{moe['shared_experts']} shared; gate_mode {moe['gate_mode']} (router weights are computed by "
                "`mergesmith moe`)"
            )
        if downloads:
            click.echo(render_downloads(downloads))


def _config_refs(config_file: Path, options: Any) -> list[str]:
    """The models a merge or mergekit-moe config names (for the hub models `plan` must look up first)."""
    from .moe.config import is_moe_config_file

    if is_moe_config_file(config_file):
        from .moe.config import load_moe_config

        return load_moe_config(config_file, strict=options.strict).referenced_models()
    from .config import load_config

    return load_config(config_file, strict=options.strict).referenced_models()


@cli.command(
    "merge-raw", short_help="Merge bare state dicts (no config.json) into OUT_DIR.", epilog=_epilog("merge-raw")
)
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_merge_options("merge-raw")
@click.option(
    "--tensor-union", "-u", is_flag=True, help="Merge a tensor some models lack from the models that have it."
)
@click.option("--tensor-intersection", "-i", is_flag=True, help="Leave out tensors that some models lack.")
@_output_options()
def merge_raw(
    config_file: Path,
    out_dir: Path,
    tensor_union: bool,
    tensor_intersection: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    verify: bool,
    **kw: Any,
) -> None:
    """Merge bare PyTorch state dicts (.safetensors, .pt, .bin; no config.json) into OUT_DIR.

    CONFIG_FILE is a merge config with `models` (file paths) and no `slices`; OUT_DIR receives
    model.safetensors (or shards and an index) and mergekit_config.yml.
    """
    from .raw.merge import run_raw_merge

    _refuse_moe_config(config_file)
    if tensor_union and tensor_intersection:
        raise ConfigError("give --tensor-union or --tensor-intersection, not both")
    options = _options(kw, "merge-raw")
    tensor_set = "union" if tensor_union else "intersection" if tensor_intersection else "exact"
    result = _run_shown(
        run_raw_merge, quiet, config_file, out_dir, options, tensor_set=tensor_set, overwrite=overwrite, force=force,
        verify=verify,
    )
    _report_result(out_dir, result)


def _refuse_moe_config(config_file: Path) -> None:
    """A mergekit-moe config (or one document of a multi-stage file that is one) belongs to `mergesmith moe`."""
    from .config import read_yaml
    from .moe.config import looks_like_moe

    try:
        documents, _text = read_yaml(config_file, all_documents=True)
    except ConfigError:
        return  # unreadable or malformed: the command itself reports it
    moe = [i for i, doc in enumerate(documents, start=1) if looks_like_moe(doc)]
    if moe:
        which = f" (document {moe[0]})" if len(documents) > 1 else ""
        raise ConfigError(
            f"{config_file}: this is a mergekit-moe config{which} (it has `experts`); use `mergesmith moe`"
        )


def _print_merge_warnings(result: Any, prefix: str = "") -> None:
    """What the merge found while running (NaN/inf in inputs or output), as the plan's warnings are printed
    (with -q too)."""
    for warning in getattr(result, "warnings", ()):
        click.echo(f"{prefix}warning: {warning}", err=True)


def _report_resume(result: Any, prefix: str = "") -> None:
    """`resumed: 8 of 75 tensors already written (...)` when the run continued an earlier one, before the
    line saying what was written: whole shards and tensors journaled inside a shard alike, so no resume
    goes unreported."""
    line = result.resume_line()
    if line is not None:
        click.echo(f"{prefix}{line}")


def _report_result(out_dir: Path, result: Any, prefix: str = "") -> None:
    """What the merge found while running, then what it resumed, where it wrote and what."""
    _print_merge_warnings(result, prefix)
    plan = result.plan
    if result.already_complete:
        click.echo(f"{prefix}{out_dir}: already complete (same config and inputs); nothing to do")
        return
    _report_resume(result, prefix)
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    click.echo(
        f"{prefix}wrote {out_dir} ({len(plan.recipes)} tensors in {len(plan.shards)} shard(s), "
        f"{human_size(plan.total_size)}) in {result.seconds:.1f}s{seed}"
    )


@cli.command(
    "multi", short_help="Run a multi-stage merge file (documents split by ---).", epilog=_epilog("multi")
)
@click.argument("config_file", type=click.Path(path_type=Path))
@click.option(
    "--out-dir",
    "--intermediate-dir",
    "-I",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Directory that receives each named stage as OUT_DIR/<name>.",
)
@click.option(
    "--out-path", type=click.Path(path_type=Path), default=None, help="Output of the unnamed final merge, if any."
)
@_hub_options
@_merge_options("multi")
@click.option(
    "--lazy/--no-lazy",
    default=True,
    show_default=True,
    help="Skip stages whose output is complete for the same config and inputs.",
)
@_output_options("Replace model files in stage directories mergesmith did not write.")
def multi_cmd(
    config_file: Path,
    out_dir: Path,
    out_path: Path | None,
    lazy: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    verify: bool,
    **kw: Any,
) -> None:
    """Run a multi-stage file (merge documents separated by `---`, each with a `name`) in dependency order.

    A later document names an earlier one's `name` as a model; each stage is written to OUT_DIR/<name>,
    and a stage whose output is complete for the same config and inputs is skipped.
    """
    from .display.terminal import StageProgress
    from .multi.stages import run_multi

    _refuse_moe_config(config_file)
    options = _options(kw, "multi")
    progress = StageProgress(lambda: _merge_progress(quiet))

    def on_stage(stage: Any, target: Path) -> None:
        progress.close()
        if not quiet:
            click.echo(f"{stage.label} -> {target}", err=True)

    with _Interrupts() as interrupts:
        try:
            results = run_multi(
                config_file,
                out_dir,
                options,
                out_path=out_path,
                lazy=lazy,
                overwrite=overwrite,
                force=force,
                verify=verify,
                on_stage=on_stage,
                on_plan=_warn_then(progress.start),
                on_progress=progress.update,
                stop=interrupts.stop,
            )
        finally:
            progress.close()
    for r in results:
        _report_result(r.out_dir, r.result, prefix=f"{r.name or '(final)'}: ")


@cli.command("moe", short_help="Build a mixture of experts from dense models.", epilog=_epilog("moe"))
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@_hub_options
@_merge_options("moe")
@click.option(
    "--i-understand-this-is-not-useful-without-training",
    "allow_all_same",
    is_flag=True,
    help="Allow every expert to be the same model with prompt-based gates (mergekit-moe's flag).",
)
@_output_options(verify=False)
def moe_cmd(
    config_file: Path,
    out_dir: Path,
    allow_all_same: bool,
    overwrite: bool,
    force: bool,
    quiet: bool,
    **kw: Any,
) -> None:
    """Assemble a mixture of experts from dense models (a mergekit-moe CONFIG_FILE) into OUT_DIR.

    Attention and norms come from `base_model`, each layer's experts from the `experts` models'
    MLPs; router weights from gate_mode (hidden, cheap_embed, random, uniform_random). Rerun to
    resume an interrupted run.
    """
    from .display.terminal import count_progress
    from .moe import run_moe

    options = _options(kw, "moe")

    def warn(message: str) -> None:
        click.echo(f"warning: {message}", err=True)

    with _Interrupts() as interrupts, count_progress("router weights", "prompts", enabled=not quiet) as router:
        with _merge_progress(quiet) as progress:

            def start(plan: Any) -> None:
                router.close()  # the router pass is over once writing starts
                progress.start(plan)

            result = run_moe(
                config_file,
                out_dir,
                options,
                overwrite=overwrite,
                force=force,
                allow_all_same=allow_all_same,
                on_plan=start,
                on_progress=progress.update,
                on_gate_progress=router.update,
                on_warning=warn,
                stop=interrupts.stop,
            )
    _print_merge_warnings(result)
    plan = result.plan
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same config and inputs); nothing to do")
        return
    moe = plan.options["moe"]
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    _report_resume(result)
    click.echo(
        f"wrote {out_dir} ({moe['architecture']}, {moe['experts']} experts, {moe['experts_per_token']} per token; "
        f"{len(plan.recipes)} tensors in {len(plan.shards)} shard(s), {human_size(plan.total_size)}) "
        f"in {result.seconds:.1f}s{seed}"
    )


@cli.command(
    "extract-lora", short_help="Extract a LoRA adapter approximating MODEL - BASE.", epilog=_epilog("extract-lora")
)
@click.option("--model", required=True, help="The fine-tuned model (path, hub id, or model+lora).")
@click.option("--base", "--base-model", "base", required=True, help="The model it was fine-tuned from.")
@click.option("--out", "--out-path", "out", required=True, type=click.Path(path_type=Path), help="Adapter directory.")
@click.option("--max-rank", type=click.IntRange(min=1), default=128, show_default=True, help="Largest LoRA rank.")
@click.option("--sv-epsilon", type=float, default=0.0, show_default=True, help="Drop singular values at or below.")
@click.option(
    "--embed-lora/--no-embed-lora",
    default=False,
    help="Factor the embedding and lm_head too (default: save them whole).",
)
@click.option(
    "--include-regex",
    "-i",
    multiple=True,
    help="Only modules whose name matches (re.search) are extracted; repeatable.",
)
@click.option("--exclude-regex", "-e", multiple=True, help="Modules whose name matches are left out; repeatable.")
@click.option(
    "--save-module", multiple=True, help="Save this module (full name or last part) whole, not factored; repeatable."
)
@click.option(
    "--skip-undecomposable",
    is_flag=True,
    help="Leave out changed modules that are not low-rank material (norms, ...) instead of saving them whole.",
)
@click.option(
    "--distribute-scale/--no-distribute-scale",
    default=True,
    show_default=True,
    help="Split the singular values evenly between A and B (off: all in A, B orthonormal).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "mps", "auto"]),
    default="cpu",
    show_default=True,
    help="Where the SVDs run.",
)
@click.option("--overwrite", is_flag=True, help="Replace an adapter already in --out.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and details.")
@_hub_options
@mergekit_flags.add_flags("extract-lora")
def extract_lora_cmd(model: str, base: str, out: Path, max_rank: int, sv_epsilon: float, **kw: Any) -> None:
    """Write a PEFT LoRA adapter approximating MODEL - BASE (truncated SVD per linear weight)."""
    from .display.terminal import count_progress
    from .io.lora_cache import lora_merge_settings
    from .lora.extract import extract_lora
    from .runtime.devices import resolve_device

    taken = mergekit_flags.take("extract-lora", kw)
    device = resolve_device(kw["device"], what="--device")
    taken.say_notes()
    if kw.get("threads"):  # -j/--num-threads: the SVDs' torch threads, as in mergekit
        import torch

        torch.set_num_threads(kw["threads"])

    with count_progress("extracting", "modules", enabled=not taken.get("quiet")) as progress:  # -v: lines above it
        result = extract_lora(
            model,
            base,
            out,
            max_rank,
            sv_epsilon=sv_epsilon,
            embed_lora=kw["embed_lora"],
            device=device,
            overwrite=kw["overwrite"],
            include=kw["include_regex"],
            exclude=kw["exclude_regex"],
            save_modules=kw["save_module"],
            skip_undecomposable=kw["skip_undecomposable"],
            distribute_scale=kw["distribute_scale"],
            lora_merge=lora_merge_settings(taken.get("lora_merge_cache"), taken.get("lora_merge_dtype")),
            on_module=(lambda m: click.echo(f"  {m}", err=True)) if kw["verbose"] else None,
            on_progress=progress.update,
        )
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    top = max(result.ranks.values(), default=0)
    click.echo(
        f"wrote {out} ({len(result.ranks)} low-rank modules, rank <= {top}; "
        f"{len(result.modules_to_save)} modules saved whole) in {result.seconds:.1f}s"
    )


# ----- tokensurgeon (issue 20): one command, all logic in tokensurgeon/ ---------------------------
_MATCH = click.Choice(["no", "yes", "embed", "lm_head"])


@cli.command(
    "tokensurgeon",
    short_help="Give a model another model's tokenizer (training-free).",
    epilog=_epilog("tokensurgeon"),
)
@click.argument("base")
@click.argument("donor")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--approximation-method",
    "-a",
    type=click.Choice(["omp", "common_interpolation", "subword", "mean", "zero", "randn"]),
    default="omp",
    show_default=True,
    help="How rows of tokens BASE lacks are made.",
)
@click.option("--k", "-k", type=int, default=64, show_default=True, help="Shared tokens per approximation.")
@click.option("--prefix-match", "-pm", type=_MATCH, default="no", is_flag=False, flag_value="yes", show_default=True,
              help="Use BASE's row of a token's longest prefix (bare flag: yes).")
@click.option("--byte-match", "-bm", type=_MATCH, default="no", is_flag=False, flag_value="yes", show_default=True,
              help="Match single characters with <0xNN> byte tokens (bare flag: yes).")
@click.option("--weight-scheme", "-w", type=click.Choice(["distance_proportional", "barycentric", "least_squares"]),
              default="distance_proportional", show_default=True, help="Weights for common_interpolation.")
@click.option("--cosine-similarity/--no-cosine-similarity", "-c/-nc", default=False,
              help="Cosine distance for common_interpolation's neighbours.")
@click.option("--subword-method", "-s", type=click.Choice(["mean", "sum", "weighted_mean", "first_last"]),
              default="mean", show_default=True, help="How subword combines a token's pieces.")
@click.option("--batch-size", type=int, default=None, help="Tokens approximated at once (default: by memory).")
@click.option("--new-vocab-noise", "-nvn", type=float, default=None, help="Gaussian noise added to new rows.")
@click.option("--new-vocab-scale", "-nvs", type=float, default=None, help="Scale applied to new rows.")
@click.option("--magikarp/--no-magikarp", default=False, hidden=True)
@_hub_options
@_merge_options("tokensurgeon")
@_output_options("Replace a different model already in OUT_DIR.", verify=False)
def tokensurgeon_cmd(base: str, donor: str, out_dir: Path, magikarp: bool, overwrite: bool, force: bool,
                     quiet: bool, **kw: Any) -> None:
    """Write BASE with DONOR's tokenizer into OUT_DIR (mergekit-tokensurgeon's options).

    Tokens both tokenizers have keep BASE's rows exactly; the others are approximated (omp: the k shared
    tokens that best rebuild the donor's embedding of the token, their weights applied to BASE's rows).
    Rerun to resume an interrupted run.
    """
    from .tokensurgeon import SurgeryOptions, run_tokensurgeon
    from .tokensurgeon.planner import describe_counts

    if magikarp:
        raise ConfigError("`--magikarp` is not supported by mergesmith tokensurgeon")
    names = ("approximation_method", "k", "prefix_match", "byte_match", "weight_scheme", "cosine_similarity",
             "subword_method", "batch_size", "new_vocab_noise", "new_vocab_scale")
    surgery = SurgeryOptions(**{n: kw.pop(n) for n in names})
    options = _options(kw, "tokensurgeon")
    result, counts = _run_shown(
        run_tokensurgeon, quiet, base, donor, out_dir, surgery, options, overwrite=overwrite, force=force
    )
    _print_merge_warnings(result)
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same inputs and options); nothing to do")
        return
    summary = result.plan.options["tokensurgeon"]
    _report_resume(result)
    click.echo(
        f"wrote {out_dir} (vocabulary {summary['vocab_size']}, {surgery.approximation_method}; "
        f"{describe_counts(counts)}) in {result.seconds:.1f}s"
    )

@cli.command(
    "evolve", short_help="Search merge parameters with CMA-ES (mergekit-evolve genomes).", epilog=_epilog("evolve")
)
@click.argument("genome_file", type=click.Path(path_type=Path))
@click.option(
    "--storage-path", required=True, type=click.Path(path_type=Path), help="Journal, history, best config."
)
@click.option("--max-fevals", type=click.IntRange(min=1), default=100, show_default=True, help="Evaluations.")
@click.option("--sigma0", type=float, default=1 / 6, show_default=True, help="Initial CMA-ES step size.")
@click.option("--random-seed", type=int, default=0, show_default=True, help="Seed (same seed, same history).")
@click.option("--popsize", type=click.IntRange(min=2), default=None, help="Candidates per generation.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Evaluation batch size.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Score each task on its first N records.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="Few-shot examples (lm-eval tasks).")
@click.option("--task-search-path", multiple=True, help="Directory of lm-eval task YAMLs (lm-eval tasks only).")
@click.option("--lm-eval-arg", multiple=True, metavar="KEY=VALUE",
              help="Passed to lm-eval's simple_evaluate (e.g. fewshot_random_seed=1); repeatable.")
@click.option("--in-memory/--no-in-memory", default=None, help="Merge candidates in memory (default: when they fit).")
@click.option("--merge-cuda/--no-merge-cuda", default=False, help="Do the merge arithmetic on the GPU.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="Where candidates are evaluated.")
@click.option("--dtype", default="bfloat16", show_default=True, help="Candidates' dtype (mergekit-evolve: bfloat16).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Torch threads (default: 1, tiny models).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: a generation's candidates are scored as Ray tasks.")
@click.option("--ray-address", default=None, help="Ray cluster to join (default: RAY_ADDRESS or a local Ray).")
@click.option("--merge-best", type=click.Path(path_type=Path), default=None, help="Write the best merge here.")
@click.option("--overwrite", is_flag=True, help="Start over when the storage path holds a different search.")
@click.option("--trust-remote-code/--no-trust-remote-code", default=False, help="Allow model code from checkpoints.")
@click.option("--allow-crimes/--no-allow-crimes", default=False, help="Merge models of different architectures.")
@click.option("--quiet/--no-quiet", "-q", "quiet", default=False,
              help="No progress (table or lines per candidate); warnings still print.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and details.")
@_hub_options
@mergekit_flags.add_flags("evolve")
def evolve_cmd(genome_file: Path, storage_path: Path, **kw: Any) -> None:
    """Find merge parameters for GENOME_FILE (mergekit-evolve's format) by CMA-ES; resumable: rerun to continue."""
    from .evolve.command import run_evolve_command

    taken = mergekit_flags.take("evolve", kw)
    taken.say_notes()
    if taken.get("save_final_model") and kw.get("merge_best") is None:  # mergekit-evolve's place for it
        kw["merge_best"] = storage_path / "final_model"
    kw["timeout"] = taken.get("timeout")

    run_evolve_command(genome_file, storage_path, kw)


def _show_downloads(quiet: bool) -> None:
    """Downloads of hub models: huggingface_hub's bars on a terminal, one line per file elsewhere, and a line
    naming the model either way; nothing with -q."""
    from .io import hub

    hub.configure(
        cache_dir=None,
        offline=False,
        progress_bars=not quiet and hub.stderr_is_terminal(),
        report=None if quiet else (lambda line: click.echo(line, err=True)),
    )


_NoArgsIsHelp = getattr(click.exceptions, "NoArgsIsHelpError", None)  # click >= 8.2


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning errors into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    prefer_huge_pages()  # before any command imports torch
    verbose = "-v" in args or "--verbose" in args
    _show_downloads(quiet="-q" in args or "--quiet" in args)
    try:
        try:
            cli.main(args=args, prog_name="mergesmith", standalone_mode=False)
        finally:
            thaw_objects()
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        if _NoArgsIsHelp is not None and isinstance(exc, _NoArgsIsHelp):
            # `mergesmith` alone: the help is the answer, not an error
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        # one line, like every other user error; `--help` has the full usage
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        message = " ".join(exc.format_message().split())
        click.echo(f"error: {message}{where}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except MergesmithError as exc:
        if verbose:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, details with -v
        if verbose:
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        click.echo(f"error: internal error: {exc.__class__.__name__}: {first} (rerun with -v for details)", err=True)
        sys.exit(1)
    sys.exit(0)


def run() -> NoReturn:
    """The console script: `main`, then a quick exit (process_tuning.exit_now), since the command owns
    its process. In-process callers (tests, notebooks) use `main`, which raises SystemExit as usual."""
    try:
        main()
    except SystemExit as exc:
        exit_now(exit_code_of(exc))
    exit_now(0)


if __name__ == "__main__":  # pragma: no cover
    run()
