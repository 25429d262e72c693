"""mergekit 0.1.5's command-line flags that mergesmith's commands have no flag of their own for, in one place.

Why: a mergekit user's command line (a notebook cell, a model card) must run with `mergekit-yaml` swapped
for `mergesmith merge`, so every flag mergekit's commands take is accepted by the counterpart
(tests/fixtures/mergekit_flags.json lists them, read from mergekit's own parser by scripts/mergekit_flags.py).
Flags mergesmith already has (`--out-shard-size`, `--allow-crimes/--no-allow-crimes`, ...) are declared in
the options model (options/families.py); this module declares the rest, per command (options/generate.py
attaches them to each command's options, for the command line and the Python API alike), and turns what was
given into what the command understands:

- a flag with a meaning here is mapped onto it (`-j` is `--threads`, `--gpu-rich` is `--device cuda`, ...);
- a flag that changes nothing here prints ONE `note:` line on stderr saying why (writes are already
  asynchronous, output is always safetensors, ...). A note is not a warning: `--strict` leaves it a note,
  since ignoring such a flag changes no output byte.

Flags that only confirm mergesmith's default (`--no-async-write`, `--safe-serialization`, ...) print nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from .errors import ConfigError

# mergesmith commands that take mergekit's MergeOptions flags (`add_merge_options` in mergekit 0.1.5)
MERGING = ("merge", "plan", "moe", "multi", "merge-raw", "tokensurgeon", "extract-lora")


@dataclass(frozen=True)
class Flag:
    """One mergekit flag as a mergesmith option.

    `decls` are click's declarations (the parameter name last); `note` is printed when the flag is given in
    the form that asks for something mergesmith does not do (`when` picks it: "on" for the flag itself,
    "any" for any value); `hidden` keeps a flag without effect out of --help (the epilog names them)."""

    decls: tuple[str, ...]
    help: str
    commands: tuple[str, ...]
    note: str | None = None
    when: str = "on"
    hidden: bool = False
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.decls[-1]


def ignored(
    decls: tuple[str, ...], commands: tuple[str, ...], note: str, help: str | None = None, when: str = "on",
    **attrs: Any,
) -> Flag:
    """A mergekit flag that changes nothing here: hidden from --help (the epilog names it), its `note` printed
    when given (`when`), its help "No effect: <note>." unless worded otherwise; `attrs` are click's."""
    return Flag(decls, help or f"No effect: {note}.", commands, note=note, when=when, hidden=True, attrs=attrs)


_DTYPES = click.Choice(["bfloat16", "float16", "float32"], case_sensitive=False)

FLAGS: tuple[Flag, ...] = (
    # ----- mergekit's MergeOptions, with a meaning here -------------------------------------------------------
    Flag(
        ("--num-threads", "-j", "num_threads"),
        "Same as --threads (mergekit's spelling).",
        MERGING,
        attrs={"type": click.IntRange(1, 256), "default": None},
    ),
    Flag(
        ("--unsafe-truncate-embeddings/--no-unsafe-truncate-embeddings", "unsafe_truncate_embeddings"),
        "Merge models whose vocabularies differ in size by keeping the first rows of the embedding and lm_head "
        "(matched by position: only right when token ids agree). Without it, or a tokenizer setting, such a "
        "merge is refused, as in mergekit.",
        ("merge", "plan", "multi", "merge-raw"),
        attrs={"default": False},
    ),
    Flag(
        ("--lora-merge-cache", "lora_merge_cache"),
        "Write each `model+lora` input merged into this directory once and read it from there (reused by "
        "later runs); default: the adapter is applied tensor by tensor as the merge reads.",
        MERGING,
        attrs={"type": click.Path(file_okay=False), "default": None},
    ),
    Flag(
        ("--lora-merge-dtype", "lora_merge_dtype"),
        "dtype of `model+lora` inputs with their adapter applied (default: each tensor's own dtype).",
        MERGING,
        attrs={"type": _DTYPES, "default": None},
    ),
    Flag(
        ("--gpu-rich", "gpu_rich"),
        "Same as --device cuda (mergekit: --cuda --low-cpu-memory --read-to-gpu --multi-gpu).",
        MERGING,
        note="runs the arithmetic on one GPU (--device cuda); inputs move there tensor by tensor, and only the "
        "tensors in flight are held in memory",
        attrs={"is_flag": True, "default": False},
    ),
    Flag(
        ("--multi-gpu/--no-multi-gpu", "multi_gpu"),
        "Same as --device cuda: the arithmetic runs on one GPU.",
        MERGING,
        note="the arithmetic runs on one GPU (--device cuda), not spread over several",
        attrs={"default": False},
    ),
    Flag(
        ("--read-to-gpu/--no-read-to-gpu", "read_to_gpu"),
        "Accepted for mergekit compatibility: with --device cuda inputs already move to the GPU as they are "
        "read; on the CPU it has no effect.",
        MERGING,
        hidden=True,
        attrs={"default": False},
    ),
    # ----- mergekit's MergeOptions, no effect here ---------------------------------------------------------------
    ignored(
        ("--low-cpu-memory/--no-low-cpu-memory", "low_cpu_memory"),
        MERGING,
        "only the tensors in flight are held in memory anyway (bound them with --max-memory)",
        default=False,
    ),
    ignored(
        ("--clone-tensors/--no-clone-tensors", "clone_tensors"),
        MERGING,
        "every output tensor is always written as its own bytes",
        default=False,
    ),
    ignored(
        ("--lazy-unpickle/--no-lazy-unpickle", "lazy_unpickle"),
        MERGING,
        "inputs are always read lazily (memory-mapped, .bin files included)",
        when="any",
        default=False,
    ),
    ignored(
        ("--safe-serialization/--no-safe-serialization", "safe_serialization"),
        MERGING,
        "output is always safetensors",
        when="off",
        default=True,
    ),
    ignored(
        ("--async-write/--no-async-write", "async_write"),
        MERGING,
        "tensors are always written as they are computed, by the worker threads (--threads)",
        default=False,
    ),
    ignored(
        ("--write-threads", "write_threads"),
        MERGING,
        "the worker threads (--threads) write each tensor as they compute it",
        when="any",
        type=click.IntRange(min=1),
        default=None,
    ),
    # ----- mergekit-extract-lora's merge options that do not apply to an adapter ----------------------------
    Flag(
        ("--cuda/--no-cuda", "cuda"),
        "Same as --device cuda.",
        ("extract-lora",),
        attrs={"default": False},
    ),
    ignored(
        ("--out-shard-size", "out_shard_size"),
        ("extract-lora",),
        "the adapter is written as one adapter_model.safetensors",
        when="any",
        default=None,
    ),
    ignored(
        ("--random-seed", "random_seed"),
        ("extract-lora",),
        "extraction (an SVD) draws no random numbers",
        when="any",
        type=int,
        default=None,
    ),
    ignored(
        ("--copy-tokenizer/--no-copy-tokenizer", "copy_tokenizer"),
        ("extract-lora",),
        "an adapter carries no tokenizer",
        default=False,
    ),
    ignored(
        ("--write-model-card/--no-write-model-card", "write_model_card"),
        ("extract-lora",),
        "the adapter directory holds adapter_config.json and adapter_model.safetensors only",
        default=False,
    ),
    ignored(
        ("--allow-crimes/--no-allow-crimes", "allow_crimes"),
        ("extract-lora",),
        "the model and base must have the same tensors and shapes",
        default=False,
    ),
    ignored(
        ("--trust-remote-code/--no-trust-remote-code", "trust_remote_code"),
        ("extract-lora",),
        "extraction reads weights only and runs no model code",
        default=False,
    ),
    ignored(
        ("--unsafe-truncate-embeddings/--no-unsafe-truncate-embeddings", "unsafe_truncate_embeddings"),
        ("extract-lora", "moe", "tokensurgeon"),
        "no embeddings of different sizes are merged by this command",
        default=False,
    ),
    Flag(
        ("--quiet/--no-quiet", "-q", "quiet"),
        "No progress display (notes and errors still print).",
        ("extract-lora",),
        attrs={"default": False},
    ),
    # ----- merge options that do nothing in merge-raw and tokensurgeon -------------------------------------------
    ignored(
        ("--copy-tokenizer/--no-copy-tokenizer", "copy_tokenizer"),
        ("merge-raw",),
        "bare state dicts have no tokenizer to copy",
        default=False,
    ),
    ignored(
        ("--write-model-card/--no-write-model-card", "write_model_card"),
        ("merge-raw",),
        "merge-raw writes the weights and mergesmith_config.yml only",
        default=False,
    ),
    ignored(
        ("--trust-remote-code/--no-trust-remote-code", "trust_remote_code"),
        ("merge-raw",),
        "merge-raw reads weights only and runs no model code",
        default=False,
    ),
    ignored(
        ("--copy-tokenizer/--no-copy-tokenizer", "copy_tokenizer"),
        ("tokensurgeon",),
        "the donor's tokenizer is always written (it is what the surgery gives BASE)",
        when="off",
        default=True,
    ),
    ignored(
        ("--allow-crimes/--no-allow-crimes", "allow_crimes"),
        ("moe",),
        "mergesmith moe has no architecture check to lift (each expert's MLP tensors must have base_model's "
        "names and shapes)",
        default=False,
    ),
    ignored(
        ("--allow-crimes/--no-allow-crimes", "allow_crimes"),
        ("tokensurgeon",),
        "BASE and DONOR may have different architectures anyway (only the donor's tokenizer and embeddings "
        "are read)",
        default=False,
    ),
    # ----- mergekit-moe ------------------------------------------------------------------------------------------
    ignored(
        ("--load-in-4bit", "load_in_4bit"),
        ("moe",),
        "gate_mode hidden runs the base model in its own dtype, not quantized (use --device cuda to move it "
        "off the CPU)",
        is_flag=True,
        default=False,
    ),
    ignored(
        ("--load-in-8bit", "load_in_8bit"),
        ("moe",),
        "gate_mode hidden runs the base model in its own dtype, not quantized (use --device cuda to move it "
        "off the CPU)",
        is_flag=True,
        default=False,
    ),
    # ----- mergekit-evolve ----------------------------------------------------------------------------------------
    Flag(
        ("--force-population-size", "force_population_size"),
        "Same as --popsize (mergekit-evolve's spelling).",
        ("evolve",),
        attrs={"type": click.IntRange(min=2), "default": None},
    ),
    Flag(
        ("--save-final-model/--no-save-final-model", "save_final_model"),
        "Write the best merge to STORAGE_PATH/final_model (as --merge-best STORAGE_PATH/final_model).",
        ("evolve",),
        attrs={"default": False},
    ),
    ignored(
        ("--strategy", "-s", "strategy"),
        ("evolve",),
        "candidates are scored one after another here, or as Ray tasks with --executor ray",
        when="any",
        type=click.Choice(["pool", "buffered", "serial"]),
        default=None,
    ),
    ignored(
        ("--num-gpus", "num_gpus"),
        ("evolve",),
        "evaluation runs on --device (one device), or on the Ray cluster's GPUs with --executor ray",
        when="any",
        type=int,
        default=None,
    ),
    ignored(
        ("--reshard/--no-reshard", "reshard"),
        ("evolve",),
        "inputs are read tensor by tensor wherever they are, so none is rewritten first",
        default=False,
    ),
    Flag(
        ("--timeout", "timeout"),
        "Start no new generation after this many seconds (the first always runs; the one running is finished "
        "and journaled; rerun to continue).",
        ("evolve",),
        attrs={"type": click.FloatRange(min=0), "default": None},
    ),
    ignored(
        ("--wandb/--no-wandb", "wandb"),
        ("evolve",),
        "the history is written to STORAGE_PATH/history.jsonl and search.png, not to Weights & Biases",
        default=False,
    ),
    ignored(
        ("--wandb-project", "wandb_project"),
        ("evolve",),
        "the history is written to STORAGE_PATH/history.jsonl, not to Weights & Biases",
        help="No effect (see --wandb).",
        when="any",
        default=None,
    ),
    ignored(
        ("--wandb-entity", "wandb_entity"),
        ("evolve",),
        "the history is written to STORAGE_PATH/history.jsonl, not to Weights & Biases",
        help="No effect (see --wandb).",
        when="any",
        default=None,
    ),
    ignored(
        ("--load-in-4bit", "load_in_4bit"),
        ("evolve",),
        "candidates are evaluated in --dtype, not quantized",
        is_flag=True,
        default=False,
    ),
    ignored(
        ("--load-in-8bit", "load_in_8bit"),
        ("evolve",),
        "candidates are evaluated in --dtype, not quantized",
        is_flag=True,
        default=False,
    ),
    ignored(
        ("--vllm/--no-vllm", "vllm"),
        ("evolve",),
        "candidates are scored with transformers (lm-eval's hf model), not vLLM",
        default=False,
    ),
    ignored(
        ("--i-understand-the-depths-of-the-evils-i-am-unleashing", "allow_benchmark_tasks"),
        ("evolve",),
        "mergesmith does not refuse benchmark tasks as objectives",
        is_flag=True,
        default=False,
    ),
)


def flags_for(command: str) -> list[Flag]:
    """The mergekit flags `command` declares through this module."""
    return [f for f in FLAGS if command in f.commands]


def hidden_names(command: str) -> list[str]:
    """The first spelling of each flag left out of `command`'s --help (named in its epilog instead)."""
    return [f.decls[0].split("/")[0] for f in flags_for(command) if f.hidden]


def epilog(command: str, mergekit_name: str) -> str:
    """The --help epilog naming the flags accepted from mergekit without effect here."""
    names = hidden_names(command)
    if not names:
        return ""
    return (
        f"Also accepted from {mergekit_name}, with no effect here (each prints a note saying why): "
        + ", ".join(names)
        + "."
    )


def _given(ctx: click.Context | None, name: str) -> bool:
    """Whether the user gave the option (on the command line or as an API keyword), not its default."""
    if ctx is None:
        return False
    source = ctx.get_parameter_source(name)
    return source is not None and source not in (
        click.core.ParameterSource.DEFAULT,
        click.core.ParameterSource.DEFAULT_MAP,
    )


class Taken(dict[str, Any]):
    """The mergekit flags' values a command took from its keywords, and the notes to print about them.

    The notes are printed by `say_notes`, which a command calls once its options are checked, so a refused
    command line prints its one `error:` line alone."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def say_notes(self, echo: Callable[[str], None] | None = None) -> None:
        say = echo or (lambda line: click.echo(line, err=True))
        for line in self.notes:
            say(line)
        self.notes.clear()


def take(command: str, kw: dict[str, Any]) -> Taken:
    """Remove `command`'s mergekit flags from `kw`, map those with a meaning onto mergesmith's options in
    `kw`, and return the removed values (for the options a command passes on by itself, such as the LoRA
    settings) with one `note:` line per flag given that has no effect here.

    Works for the command line (the current click context says what was given) and for the API (no
    context: a value other than the default counts as given)."""
    ctx = click.get_current_context(silent=True)
    taken = Taken()
    for flag in flags_for(command):
        if flag.name not in kw:
            continue
        value = kw.pop(flag.name)
        taken[flag.name] = value
        default = flag.attrs.get("default")
        given = _given(ctx, flag.name) if ctx is not None and ctx.command.name == command else value != default
        if not given or flag.note is None:
            continue
        asked = flag.when == "any" or (flag.when == "on" and value) or (flag.when == "off" and value is False)
        if asked:
            spelling = flag.decls[0].split("/")[0 if flag.when != "off" else 1]
            taken.notes.append(f"note: `{spelling}` has no effect here: {flag.note}")
    _map(kw, taken)
    return taken


def _map(kw: dict[str, Any], taken: Taken) -> None:
    """The flags with a meaning here, onto mergesmith's own options in `kw`."""
    threads = taken.get("num_threads")
    if threads is not None:
        if kw.get("threads") not in (None, threads):
            raise ConfigError(f"`-j/--num-threads {threads}` and `--threads {kw['threads']}` disagree; give one")
        kw["threads"] = threads
    popsize = taken.get("force_population_size")
    if popsize is not None:
        if kw.get("popsize") not in (None, popsize):
            raise ConfigError(f"`--force-population-size {popsize}` and `--popsize {kw['popsize']}` disagree; give one")
        kw["popsize"] = popsize
    wants_gpu = taken.get("gpu_rich") or taken.get("multi_gpu") or taken.get("cuda")
    if wants_gpu:
        device = kw.get("device", "cpu")
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            which = "--gpu-rich" if taken.get("gpu_rich") else "--multi-gpu" if taken.get("multi_gpu") else "--cuda"
            raise ConfigError(f"`{which}` asks for the GPU (cuda) but `--device {device}` was given; give one")
        if device == "cpu":
            kw["device"] = "cuda"
    if taken.get("read_to_gpu") and kw.get("device", "cpu") == "cpu" and not kw.get("cuda"):
        taken.notes.append(
            "note: `--read-to-gpu` has no effect here: the arithmetic runs on the CPU (add --cuda or --device cuda)"
        )
