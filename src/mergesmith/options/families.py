"""Every command's options, declared once: one dataclass per family, each field one option (see spec.py).

To add an option: add a field to the family whose commands take it (`SharedMerge` for every merging command).
The click option, the Python API's keyword argument, its check and docs/options.md all follow, and a
`SharedMerge` value reaches the engine's MergeOptions by its name (a MergeOptions field of that name, else
`MergeOptions.extra[name]`; convert.to_merge_options). README: "Adding an option".
mergekit's own flags stay in mergekit_flags.py's table and join each command's list through `LAYOUTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .spec import Layout, Part, opt_of, option, reuse


def _set_cache(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    from ..io import hub

    hub.configure(cache_dir=value)
    return value


def _set_offline(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    from ..io import hub

    hub.configure(offline=value)
    return value


@dataclass
class Hub:
    """Where hub models are cached and whether they may be downloaded: options of every command that reads
    models. They set io.hub's process-wide settings as they are parsed, so no command passes them on."""

    transformers_cache: Path | None = option(
        "--transformers-cache",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where hub models are looked up and downloaded (default: the Hugging Face cache, HF_HUB_CACHE).",
        attrs={"expose_value": False, "callback": _set_cache},
    )
    offline: bool = option(
        "--offline",
        is_flag=True,
        help="Never download: a hub id must already be in the cache (as HF_HUB_OFFLINE=1).",
        attrs={"expose_value": False, "callback": _set_offline},
    )


_STRICT_MERGE = (
    "Treat every warning as an error: an unknown key or a parameter the method does not use (which mergekit "
    "ignores), a suspicious parameter value, NaN/inf in the inputs, a plan's warnings."
)


@dataclass
class SharedMerge:
    """The options every merging command shares (merge, plan, merge-raw, multi, moe, tokensurgeon), worded for
    each command where it does something different there; they become the engine's MergeOptions
    (convert.to_merge_options)."""

    out_shard_size: str = option(
        "--out-shard-size",
        default="5B",
        show_default=True,
        help="Bytes of tensor data per output shard: 5B, 500M, 2G...",
    )
    random_seed: int | None = option(
        "--random-seed",
        type=int,
        default=None,
        help={
            "*": "Seed for randomised methods (DARE, DELLA, ...; default: drawn and recorded).",
            "moe": "Seed for gate_mode random and uniform_random router weights (default: drawn and recorded).",
            "tokensurgeon": "Seed for --approximation-method randn and --new-vocab-noise (default: drawn and "
            "recorded).",
        },
    )
    copy_tokenizer: bool = option(
        "--copy-tokenizer/--no-copy-tokenizer",
        default=True,
        show_default=True,
        help={"*": "Copy the tokenizer (from the base model or tokenizer_source).", "moe": "Copy base_model's "
              "tokenizer to OUT_DIR."},
        omit=("merge-raw", "tokensurgeon"),
    )
    write_model_card: bool = option(
        "--write-model-card/--no-write-model-card",
        default=True,
        show_default=True,
        help={
            "*": "Write a README.md model card naming the method and the models merged.",
            "moe": "Write a README.md model card naming the base model, the experts and the gate mode.",
            "tokensurgeon": "Write a README.md model card naming BASE, DONOR and the approximation method.",
        },
        omit=("merge-raw",),
    )
    out_quantization: str = option(
        "--out-quantization",
        type=click.Choice(["none", "same", "fp8", "mxfp4"]),
        default="none",
        show_default=True,
        help="Write the tensors the inputs store quantized (FP8 block-scaled, MXFP4) quantized again, same format "
        "and block size with fresh scales, keeping the inputs' quantization_config (same: whichever they use); "
        "none writes them in the output dtype.",
        omit=("merge-raw", "moe", "tokensurgeon"),
    )
    allow_crimes: bool = option(
        "--allow-crimes/--no-allow-crimes",
        default=False,
        help="Merge models of different architectures.",
        omit=("moe", "tokensurgeon"),
    )
    trust_remote_code: bool = option(
        "--trust-remote-code/--no-trust-remote-code",
        default=False,
        help="Allow model code from checkpoints (off by default).",
        omit=("merge-raw",),
    )
    strict: bool = option(
        "--strict",
        is_flag=True,
        help={
            "*": _STRICT_MERGE,
            "moe": "Treat every warning as an error: an unknown config key, NaN/inf in the inputs, a plan's warnings.",
            "tokensurgeon": "Treat every warning as an error: NaN/inf in the inputs, a plan's warnings.",
        },
    )
    device: str = option(
        "--device",
        type=click.Choice(["cpu", "cuda", "mps", "auto"]),
        default="cpu",
        show_default=True,
        help={
            "*": "Where the merge arithmetic runs.",
            "moe": "Where the router pass (gate_mode hidden) and the arithmetic run.",
            "tokensurgeon": "Where the approximation of the new rows runs.",
        },
    )
    cuda: bool = option("--cuda/--no-cuda", default=False, help="Same as --device cuda.")
    threads: int | None = option(
        "--threads",
        type=click.IntRange(1, 256),
        default=None,
        help="Worker threads (default: number of cores).",
    )
    max_memory: str | None = option("--max-memory", default=None, help="Bound on bytes in flight, e.g. 8GB.")
    max_gpu_memory: str | None = option(
        "--max-gpu-memory",
        default=None,
        help="With --device cuda: bound on GPU bytes in flight, e.g. 20GB (default: 90% of the GPU's free memory).",
    )
    executor: str = option(
        "--executor",
        type=click.Choice(["local", "ray"]),
        default="local",
        show_default=True,
        help="local: a thread pool here; ray: one Ray task per output shard (needs `pip install "
        "mergesmith[ray]` and OUT_DIR and the inputs on a filesystem every node shares).",
    )
    ray_address: str | None = option(
        "--ray-address",
        default=None,
        help="Ray cluster to join (`auto`, `HOST:6379`, `ray://HOST:10001`); default: RAY_ADDRESS or a local Ray.",
    )
    verbose: bool = option("-v", "--verbose", is_flag=True, help="Show tracebacks and details.", face_only=True)


@dataclass
class Output:
    """The options of every command that writes a model into OUT_DIR (--verify where a rerun may trust a
    complete output); they become the engine's RunControls."""

    overwrite: bool = option(
        "--overwrite",
        is_flag=True,
        help={
            "*": "Replace a different merge already in OUT_DIR.",
            "multi": "Replace model files in stage directories mergesmith did not write.",
            "tokensurgeon": "Replace a different model already in OUT_DIR.",
        },
    )
    force: bool = option("--force", is_flag=True, help="Start even if the disk looks too small.")
    quiet: bool = option(
        "--quiet/--no-quiet", "-q", default=False, help="No progress display (warnings and errors still print)."
    )
    verify: bool = option(
        "--verify",
        is_flag=True,
        help="Checksum every shard of a complete output instead of trusting its unchanged size and mtime.",
        omit=("moe", "tokensurgeon"),
    )


@dataclass
class Plan:
    """`mergesmith plan`'s own: how the report is printed (not API keywords: the API returns the report)."""

    as_json: bool = option("--json", is_flag=True, help="Print the plan as JSON.")
    tensors: bool = option("--tensors/--no-tensors", default=False, help="List every output tensor.")


@dataclass
class MergeRaw:
    """`mergesmith merge-raw`'s own: which tensors a merge of state dicts that differ writes."""

    tensor_union: bool = option(
        "--tensor-union", "-u", is_flag=True, help="Merge a tensor some models lack from the models that have it."
    )
    tensor_intersection: bool = option(
        "--tensor-intersection", "-i", is_flag=True, help="Leave out tensors that some models lack."
    )


@dataclass
class Multi:
    """`mergesmith multi`'s own: where the stages go, and whether a complete stage is skipped."""

    out_dir: Path = option(
        "--out-dir",
        "--intermediate-dir",
        "-I",
        type=click.Path(path_type=Path),
        required=True,
        help="Directory that receives each named stage as OUT_DIR/<name>.",
    )
    out_path: Path | None = option(
        "--out-path", type=click.Path(path_type=Path), default=None, help="Output of the unnamed final merge, if any."
    )
    lazy: bool = option(
        "--lazy/--no-lazy",
        default=True,
        show_default=True,
        help="Skip stages whose output is complete for the same config and inputs.",
    )


@dataclass
class Moe:
    """`mergesmith moe`'s own."""

    allow_all_same: bool = option(
        "--i-understand-this-is-not-useful-without-training",
        is_flag=True,
        help="Allow every expert to be the same model with prompt-based gates (mergekit-moe's flag).",
    )


@dataclass
class ExtractLora:
    """`mergesmith extract-lora`'s options (mergekit's merge options it accepts are mergekit flags there)."""

    model: str = option("--model", required=True, help="The fine-tuned model (path, hub id, or model+lora).")
    base: str = option("--base", "--base-model", required=True, help="The model it was fine-tuned from.")
    out: Path = option("--out", "--out-path", required=True, type=click.Path(path_type=Path), help="Adapter directory.")
    max_rank: int = option(
        "--max-rank", type=click.IntRange(min=1), default=128, show_default=True, help="Largest LoRA rank."
    )
    sv_epsilon: float = option(
        "--sv-epsilon", type=float, default=0.0, show_default=True, help="Drop singular values at or below."
    )
    embed_lora: bool = option(
        "--embed-lora/--no-embed-lora",
        default=False,
        help="Factor the embedding and lm_head too (default: save them whole).",
    )
    include_regex: tuple[str, ...] = option(
        "--include-regex",
        "-i",
        multiple=True,
        help="Only modules whose name matches (re.search) are extracted; repeatable.",
    )
    exclude_regex: tuple[str, ...] = option(
        "--exclude-regex", "-e", multiple=True, help="Modules whose name matches are left out; repeatable."
    )
    save_module: tuple[str, ...] = option(
        "--save-module",
        multiple=True,
        help="Save this module (full name or last part) whole, not factored; repeatable.",
    )
    skip_undecomposable: bool = option(
        "--skip-undecomposable",
        is_flag=True,
        help="Leave out changed modules that are not low-rank material (norms, ...) instead of saving them whole.",
    )
    distribute_scale: bool = option(
        "--distribute-scale/--no-distribute-scale",
        default=True,
        show_default=True,
        help="Split the singular values evenly between A and B (off: all in A, B orthonormal).",
    )
    device: str = reuse(opt_of(SharedMerge, "device"), help="Where the SVDs run.")
    overwrite: bool = reuse(opt_of(Output, "overwrite"), help="Replace an adapter already in --out.")
    verbose: bool = reuse(opt_of(SharedMerge, "verbose"))


_MATCH = click.Choice(["no", "yes", "embed", "lm_head"])


def _match_option(long: str, short: str, what: str) -> Any:
    """tokensurgeon's no/yes/embed/lm_head switches, where the bare flag means yes (mergekit's spelling)."""
    return option(
        long, short, type=_MATCH, default="no", is_flag=False, show_default=True,
        help=f"{what} (bare flag: yes).", attrs={"flag_value": "yes"},
    )


@dataclass
class Tokensurgeon:
    """`mergesmith tokensurgeon`'s own (mergekit-tokensurgeon's), which become its SurgeryOptions."""

    approximation_method: str = option(
        "--approximation-method",
        "-a",
        type=click.Choice(["omp", "common_interpolation", "subword", "mean", "zero", "randn"]),
        default="omp",
        show_default=True,
        help="How rows of tokens BASE lacks are made.",
    )
    k: int = option("--k", "-k", type=int, default=64, show_default=True, help="Shared tokens per approximation.")
    prefix_match: str = _match_option("--prefix-match", "-pm", "Use BASE's row of a token's longest prefix")
    byte_match: str = _match_option("--byte-match", "-bm", "Match single characters with <0xNN> byte tokens")
    weight_scheme: str = option(
        "--weight-scheme",
        "-w",
        type=click.Choice(["distance_proportional", "barycentric", "least_squares"]),
        default="distance_proportional",
        show_default=True,
        help="Weights for common_interpolation.",
    )
    cosine_similarity: bool = option(
        "--cosine-similarity/--no-cosine-similarity",
        "-c/-nc",
        default=False,
        help="Cosine distance for common_interpolation's neighbours.",
    )
    subword_method: str = option(
        "--subword-method",
        "-s",
        type=click.Choice(["mean", "sum", "weighted_mean", "first_last"]),
        default="mean",
        show_default=True,
        help="How subword combines a token's pieces.",
    )
    batch_size: int | None = option(
        "--batch-size", type=int, default=None, help="Tokens approximated at once (default: by memory)."
    )
    new_vocab_noise: float | None = option(
        "--new-vocab-noise", "-nvn", type=float, default=None, help="Gaussian noise added to new rows."
    )
    new_vocab_scale: float | None = option(
        "--new-vocab-scale", "-nvs", type=float, default=None, help="Scale applied to new rows."
    )
    magikarp: bool = option("--magikarp/--no-magikarp", default=False, hidden=True)


@dataclass
class Evolve:
    """`mergesmith evolve`'s options: its own, and the shared ones it reuses, worded for a search (which
    becomes evolve's SearchOptions, not a MergeOptions)."""

    storage_path: Path = option(
        "--storage-path", required=True, type=click.Path(path_type=Path), help="Journal, history, best config."
    )
    max_fevals: int = option(
        "--max-fevals", type=click.IntRange(min=1), default=100, show_default=True, help="Evaluations."
    )
    sigma0: float = option("--sigma0", type=float, default=1 / 6, show_default=True, help="Initial CMA-ES step size.")
    random_seed: int = reuse(
        opt_of(SharedMerge, "random_seed"), default=0, show_default=True, help="Seed (same seed, same history)."
    )
    popsize: int | None = option(
        "--popsize", type=click.IntRange(min=2), default=None, help="Candidates per generation."
    )
    batch_size: int = option(
        "--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Evaluation batch size."
    )
    limit: int | None = option(
        "--limit", type=click.IntRange(min=1), default=None, help="Score each task on its first N records."
    )
    num_fewshot: int | None = option(
        "--num-fewshot", type=click.IntRange(min=0), default=None, help="Few-shot examples (lm-eval tasks)."
    )
    task_search_path: tuple[str, ...] = option(
        "--task-search-path", multiple=True, help="Directory of lm-eval task YAMLs (lm-eval tasks only)."
    )
    lm_eval_arg: tuple[str, ...] = option(
        "--lm-eval-arg",
        multiple=True,
        help="Passed to lm-eval's simple_evaluate (e.g. fewshot_random_seed=1); repeatable.",
        attrs={"metavar": "KEY=VALUE"},
    )
    in_memory: bool | None = option(
        "--in-memory/--no-in-memory", default=None, help="Merge candidates in memory (default: when they fit)."
    )
    merge_cuda: bool = option("--merge-cuda/--no-merge-cuda", default=False, help="Do the merge arithmetic on the GPU.")
    device: str = reuse(
        opt_of(SharedMerge, "device"),
        type=click.Choice(["cpu", "cuda", "auto"]),
        help="Where candidates are evaluated.",
    )
    dtype: str = option(
        "--dtype", default="bfloat16", show_default=True, help="Candidates' dtype (mergekit-evolve: bfloat16)."
    )
    threads: int | None = reuse(opt_of(SharedMerge, "threads"), help="Torch threads (default: 1, tiny models).")
    executor: str = reuse(
        opt_of(SharedMerge, "executor"), help="ray: a generation's candidates are scored as Ray tasks."
    )
    ray_address: str | None = reuse(
        opt_of(SharedMerge, "ray_address"), help="Ray cluster to join (default: RAY_ADDRESS or a local Ray)."
    )
    merge_best: Path | None = option(
        "--merge-best", type=click.Path(path_type=Path), default=None, help="Write the best merge here."
    )
    overwrite: bool = reuse(
        opt_of(Output, "overwrite"), help="Start over when the storage path holds a different search."
    )
    trust_remote_code: bool = reuse(
        opt_of(SharedMerge, "trust_remote_code"), help="Allow model code from checkpoints."
    )
    allow_crimes: bool = reuse(opt_of(SharedMerge, "allow_crimes"))
    quiet: bool = reuse(
        opt_of(Output, "quiet"), help="No progress (table or lines per candidate); warnings still print."
    )
    verbose: bool = reuse(opt_of(SharedMerge, "verbose"))


MERGEKIT = Part(None)  # the command's mergekit flags (mergekit_flags.FLAGS), where mergekit's parser has them


def _all(family: type) -> Part:
    return Part(family)


# Each command's options in --help order (a part at a time). The command's positional arguments stay in cli.py.
LAYOUTS: dict[str, Layout] = {
    "merge": (_all(Hub), _all(SharedMerge), MERGEKIT, _all(Output)),
    "plan": (_all(Hub), _all(SharedMerge), MERGEKIT, _all(Plan)),
    "merge-raw": (_all(Hub), _all(SharedMerge), MERGEKIT, _all(MergeRaw), _all(Output)),
    "multi": (
        Part(Multi, ("out_dir", "out_path")),
        _all(Hub),
        _all(SharedMerge),
        MERGEKIT,
        Part(Multi, ("lazy",)),
        _all(Output),
    ),
    "moe": (_all(Hub), _all(SharedMerge), MERGEKIT, _all(Moe), _all(Output)),
    "extract-lora": (_all(ExtractLora), _all(Hub), MERGEKIT),
    "tokensurgeon": (_all(Tokensurgeon), _all(Hub), _all(SharedMerge), MERGEKIT, _all(Output)),
    "evolve": (_all(Evolve), _all(Hub), MERGEKIT),
}

# What each command's mergekit counterpart is called (the --help epilog names the flags taken from it).
MERGEKIT_NAMES = {
    "merge": "mergekit-yaml",
    "plan": "mergekit-yaml",
    "moe": "mergekit-moe",
    "multi": "mergekit-multi",
    "merge-raw": "mergekit-pytorch",
    "tokensurgeon": "mergekit-tokensurgeon",
    "extract-lora": "mergekit-extract-lora",
    "evolve": "mergekit-evolve",
}

# The Python API's function for each command that has one (python_api.py), and the options it does not take as
# keywords (positional there, or about printing the report it returns instead).
API_FUNCTIONS: dict[str, str] = {
    "merge": "merge",
    "plan": "plan",
    "merge-raw": "merge_raw",
    "multi": "multi",
    "moe": "moe",
    "extract-lora": "extract_lora",
}
API_EXCLUDE: dict[str, tuple[str, ...]] = {
    "plan": ("as_json", "tensors"),
    "multi": ("out_dir",),
    "extract-lora": ("model", "base", "out"),
}
