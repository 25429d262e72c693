"""The `mergesmith` command line: argument handling and printing, no logic of its own.

Every command's options come from the options model (options/: declared once, generated here as click options
and in python_api.py as keyword arguments); the progress displays and Ctrl-C handling are display/'s.

A user mistake prints one line (`error: ...`) and exits 2; an unexpected failure prints one line
too and exits 1, with the traceback only under `-v`.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from . import mergekit_flags
from .display.command_output import (
    merge_progress,
    print_merge_warnings,
    report_result,
    report_resume,
    run_shown,
    warn_then,
)
from .display.interrupts import Interrupts
from .errors import ConfigError, MergesmithError
from .options import click_options, epilog, to_merge_options, to_run_controls
from .runtime.process_tuning import (
    exit_code_of,
    exit_now,
    prefer_huge_pages,
    quiet_collector_while_starting,
    skip_numba_blas,
    thaw_objects,
)
from .sizes import human_size


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergesmith")
def cli() -> None:
    """Merge language-model checkpoints (mergekit configs, streamed, resumable)."""



def _config_and_out_dir(command: Any) -> Any:
    """CONFIG_FILE OUT_DIR: the arguments of the commands that merge one config into one directory."""
    command = click.argument("out_dir", type=click.Path(path_type=Path))(command)
    return click.argument("config_file", type=click.Path(path_type=Path))(command)

@cli.command(short_help="Merge a mergekit config into OUT_DIR (resumable).", epilog=epilog("merge"))
@_config_and_out_dir
@click_options("merge")
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
    options = to_merge_options(kw, "merge")
    controls = to_run_controls({"overwrite": overwrite, "force": force, "verify": verify})
    result = run_shown(run_merge, quiet, config_file, out_dir, options, controls=controls)
    import_manifest.record()  # for the next merge's start
    report_result(out_dir, result)


@cli.command("plan", short_help="Show what a merge will do and cost, from headers.", epilog=epilog("plan"))
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path), required=False)
@click_options("plan")
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
    options = to_merge_options(kw, "plan")
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
    report = plan_report(plan, checkpoints, out_dir, options, downloads)
    moe = report.get("moe")
    transplant = report.get("tokensurgeon")  # `tokenizer_source: transplant:<donor>`
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
    "merge-raw", short_help="Merge bare state dicts (no config.json) into OUT_DIR.", epilog=epilog("merge-raw")
)
@_config_and_out_dir
@click_options("merge-raw")
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
    options = to_merge_options(kw, "merge-raw")
    tensor_set = "union" if tensor_union else "intersection" if tensor_intersection else "exact"
    controls = to_run_controls({"overwrite": overwrite, "force": force, "verify": verify})
    result = run_shown(run_raw_merge, quiet, config_file, out_dir, options, tensor_set=tensor_set, controls=controls)
    report_result(out_dir, result)


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


@cli.command(
    "multi", short_help="Run a multi-stage merge file (documents split by ---).", epilog=epilog("multi")
)
@click.argument("config_file", type=click.Path(path_type=Path))
@click_options("multi")
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
    options = to_merge_options(kw, "multi")
    progress = StageProgress(lambda: merge_progress(quiet))

    def on_stage(stage: Any, target: Path) -> None:
        progress.close()
        if not quiet:
            click.echo(f"{stage.label} -> {target}", err=True)

    with Interrupts() as interrupts:
        try:
            controls = to_run_controls(
                {"overwrite": overwrite, "force": force, "verify": verify},
                on_plan=warn_then(progress.start),
                on_progress=progress.update,
                stop=interrupts.stop,
            )
            results = run_multi(
                config_file, out_dir, options, out_path=out_path, lazy=lazy, controls=controls, on_stage=on_stage
            )
        finally:
            progress.close()
    for r in results:
        report_result(r.out_dir, r.result, prefix=f"{r.name or '(final)'}: ")


@cli.command("moe", short_help="Build a mixture of experts from dense models.", epilog=epilog("moe"))
@_config_and_out_dir
@click_options("moe")
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

    options = to_merge_options(kw, "moe")

    def warn(message: str) -> None:
        click.echo(f"warning: {message}", err=True)

    with Interrupts() as interrupts, count_progress("router weights", "prompts", enabled=not quiet) as router:
        with merge_progress(quiet) as progress:

            def start(plan: Any) -> None:
                router.close()  # the router pass is over once writing starts
                progress.start(plan)

            controls = to_run_controls(
                {"overwrite": overwrite, "force": force},
                on_plan=start,
                on_progress=progress.update,
                stop=interrupts.stop,
            )
            result = run_moe(
                config_file,
                out_dir,
                options,
                controls=controls,
                allow_all_same=allow_all_same,
                on_gate_progress=router.update,
                on_warning=warn,
            )
    print_merge_warnings(result)
    plan = result.plan
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same config and inputs); nothing to do")
        return
    moe = plan.options["moe"]
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    report_resume(result)
    click.echo(
        f"wrote {out_dir} ({moe['architecture']}, {moe['experts']} experts, {moe['experts_per_token']} per token; "
        f"{len(plan.recipes)} tensors in {len(plan.shards)} shard(s), {human_size(plan.total_size)}) "
        f"in {result.seconds:.1f}s{seed}"
    )


@cli.command(
    "extract-lora", short_help="Extract a LoRA adapter approximating MODEL - BASE.", epilog=epilog("extract-lora")
)
@click_options("extract-lora")
def extract_lora_cmd(model: str, base: str, out: Path, **kw: Any) -> None:
    """Write a PEFT LoRA adapter approximating MODEL - BASE (truncated SVD per linear weight)."""
    from .display.terminal import count_progress
    from .lora.extract import extract_lora
    from .options.convert import to_extract_arguments

    quiet = bool(kw.get("quiet"))  # mergekit-extract-lora's -q (a mergekit flag: `kw` loses it below)
    arguments = to_extract_arguments(kw)
    if kw.get("threads"):  # -j/--num-threads: the SVDs' torch threads, as in mergekit
        import torch

        torch.set_num_threads(kw["threads"])

    with count_progress("extracting", "modules", enabled=not quiet) as progress:  # -v: lines above it
        result = extract_lora(
            model,
            base,
            out,
            **arguments,
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
@cli.command(
    "tokensurgeon",
    short_help="Give a model another model's tokenizer (training-free).",
    epilog=epilog("tokensurgeon"),
)
@click.argument("base")
@click.argument("donor")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click_options("tokensurgeon")
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
    options = to_merge_options(kw, "tokensurgeon")
    controls = to_run_controls({"overwrite": overwrite, "force": force})
    result, counts = run_shown(run_tokensurgeon, quiet, base, donor, out_dir, surgery, options, controls=controls)
    print_merge_warnings(result)
    if result.already_complete:
        click.echo(f"{out_dir}: already complete (same inputs and options); nothing to do")
        return
    summary = result.plan.options["tokensurgeon"]
    report_resume(result)
    click.echo(
        f"wrote {out_dir} (vocabulary {summary['vocab_size']}, {surgery.approximation_method}; "
        f"{describe_counts(counts)}) in {result.seconds:.1f}s"
    )


@cli.command(
    "evolve", short_help="Search merge parameters with CMA-ES (mergekit-evolve genomes).", epilog=epilog("evolve")
)
@click.argument("genome_file", type=click.Path(path_type=Path))
@click_options("evolve")
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
    quiet_collector_while_starting()  # until the plan is built, or the command ends (thaw_objects)
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
    its process (which also loads numba without scipy's BLAS: process_tuning.skip_numba_blas). In-process callers
    (tests, notebooks) use `main`, which raises SystemExit as usual."""
    skip_numba_blas()
    try:
        main()
    except SystemExit as exc:
        exit_now(exit_code_of(exc))
    exit_now(0)


if __name__ == "__main__":  # pragma: no cover
    run()
