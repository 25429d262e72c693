"""The checkpoints bench/device_commands.py runs `tokensurgeon` and `extract-lora` on, built offline and cached.

Three llama-style bf16 models of one width and a small side file:

- `base`: the recipient, with a word-level tokenizer of `base_vocab` tokens; untied embedding and lm_head, as
  most llama-family models have, so a transplant rebuilds two vocabulary matrices;
- `donor`: a model with another tokenizer of `donor_vocab` tokens, of which `shared` (the specials included) are
  the base's, in another order; so `donor_vocab - shared` tokens must be approximated (34,000 at the realistic
  size: a 32k-to-50k-token transplant at hidden 4096, as issue 33 asks). Its embedding is tied;
- `finetune`: the base plus a rank-`lora_rank` delta on every linear weight of the layers (embedding, head and
  norms unchanged), for `extract-lora --max-rank lora_rank`;
- `truth.safetensors`: what each approximated row should be.

Why a known answer: the commands' cost does not depend on the values (OMP always takes k steps), but a check
that only says "finite, right shape" would pass a transplant that applied the right coefficients to the wrong
rows. So each new donor token's embedding is an exact combination of `mix` shared tokens' donor rows, and the
transplanted row should be the same combination of the base's rows of those tokens: `truth.safetensors` holds,
per new token, its donor id, the base ids of its shared tokens and their coefficients. Every other value is
Gaussian (std 0.02), drawn per tensor from a seed derived from the size and the tensor's name.

Why written directly: transformers' random init of a hidden-4096 model with a 50k vocabulary takes minutes on a
few cores; drawing each tensor with torch.randn and streaming it into the safetensors file (bench/make_models.py's
writer) takes seconds and holds one tensor at a time. Each set is built in a temporary folder renamed at the end,
with bench/make_models.py's `.bench-complete` marker: a complete set is reused, a half-written one rebuilt.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from benchlib import log
from make_models import MARKER, TensorSpec, _generator, _header, _write_tensor, is_complete, tensor_specs

FORMAT_VERSION = 1  # bump when the generated values or layout change, so cached sets are rebuilt
STD = 0.02
DELTA_RMS = 0.004  # the fine-tune's delta, entry rms: 10x bf16's rounding of a 0.02 weight (see check tolerances)
SPECIALS = ("<unk>", "<s>", "</s>")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class CommandSize:
    """One size of the pair. `expected_s`: about how long the device step takes there (build, both commands,
    checks) on the machine it is meant for: an H100 for `realistic`, a 2-core CPU for the others."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    base_vocab: int
    donor_vocab: int
    shared: int  # tokens both tokenizers have, the 3 specials included
    k: int  # OMP's atoms per new token (mergekit-tokensurgeon's -k)
    mix: int  # shared tokens each new donor token is made of
    lora_rank: int
    expected_s: float

    @property
    def new_tokens(self) -> int:
        return self.donor_vocab - self.shared


SIZES: dict[str, CommandSize] = {
    # a 32k-to-50k transplant at hidden 4096 (34,000 new tokens over 16,000 shared ones), Mistral-7B's attention
    # shapes in one layer; the MLP is narrow to keep the files small (0.6 GB base, 0.5 GB donor)
    "realistic": CommandSize(4096, 32, 8, 1024, 1, 32_000, 50_000, 16_000, 64, 4, 16, 60.0),
    # the same pipeline in about half a minute on a 2-core CPU
    "quick": CommandSize(1024, 8, 2, 1024, 1, 4_000, 6_000, 2_000, 32, 3, 8, 40.0),
    # for the tests of the plumbing: seconds
    "tiny": CommandSize(128, 2, 1, 128, 1, 300, 400, 200, 8, 2, 4, 15.0),
}


@dataclass(frozen=True)
class CommandModels:
    """Where one built set lives."""

    root: Path

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def donor(self) -> Path:
        return self.root / "donor"

    @property
    def finetune(self) -> Path:
        return self.root / "finetune"

    @property
    def truth(self) -> Path:
        return self.root / "truth.safetensors"


def _fingerprint(name: str, size: CommandSize, seed: int) -> dict[str, Any]:
    """What the files depend on (not the time estimate: retuning it must not rebuild them)."""
    spec = {k: v for k, v in asdict(size).items() if k != "expected_s"}
    return {"version": FORMAT_VERSION, "size": name, "seed": seed, "spec": spec}


def ensure_command_models(name: str, work: Path, seed: int = 0, quiet: bool = False) -> CommandModels:
    """The set of size `name` under `work`, built if it is missing or stale."""
    size = SIZES[name]
    models = CommandModels(work / name)
    fingerprint = _fingerprint(name, size, seed)
    if is_complete(models.root, fingerprint):
        return models
    started = time.perf_counter()
    tmp = CommandModels(work / f"{name}.tmp")
    shutil.rmtree(tmp.root, ignore_errors=True)
    words = _vocabularies(size, seed)
    _write_tokenizer(tmp.base, words["base"])
    _write_tokenizer(tmp.donor, words["donor"])
    base_config, donor_config = _config(size, size.base_vocab, tied=False), _config(size, size.donor_vocab, tied=True)
    for path, config in ((tmp.base, base_config), (tmp.finetune, base_config), (tmp.donor, donor_config)):
        config.save_pretrained(path)
    _write_base_and_finetune(tmp, base_config, size, (name, seed))
    _write_donor_and_truth(tmp, donor_config, size, words, (name, seed))
    files = {str(p.relative_to(tmp.root)): p.stat().st_size for p in tmp.root.rglob("*") if p.is_file()}
    (tmp.root / MARKER).write_text(json.dumps({"fingerprint": fingerprint, "files": files}, indent=1) + "\n")
    shutil.rmtree(models.root, ignore_errors=True)
    tmp.root.rename(models.root)
    if not quiet:
        total = sum(files.values())
        log(f"{models.root}: built in {time.perf_counter() - started:.1f} s ({total / 1e9:.2f} GB)")
    return models


# ----------------------------------------------------------------------------------------------- tokenizers


def _vocabularies(size: CommandSize, seed: int) -> dict[str, list[str]]:
    """The two vocabularies in id order: the specials, then words. The donor keeps the base's last `shared - 3`
    words and adds `new_tokens` of its own, shuffled, so no shared token has the same id in both."""
    words = [f"w{i}" for i in range(size.base_vocab + size.new_tokens)]
    base_words = words[: size.base_vocab - len(SPECIALS)]
    kept = base_words[len(base_words) - (size.shared - len(SPECIALS)) :]
    donor_words = kept + words[len(base_words) : len(base_words) + size.new_tokens]
    random.Random(seed).shuffle(donor_words)
    return {"base": [*SPECIALS, *base_words], "donor": [*SPECIALS, *donor_words]}


def _write_tokenizer(path: Path, vocab: list[str]) -> None:
    """A word-level tokenizer over whitespace (`tokenizers`), saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token=SPECIALS[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                        eos_token=SPECIALS[2])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))


# ----------------------------------------------------------------------------------------------- weights


def _config(size: CommandSize, vocab: int, tied: bool) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def _gaussian(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    """float32 values for one tensor: N(0, STD), norms (1-D) around 1."""
    values = torch.randn(shape, generator=_generator(*key), dtype=torch.float32).mul_(STD)
    return values.add_(1.0) if len(shape) == 1 else values


def _low_rank_delta(shape: tuple[int, ...], rank: int, *key: object) -> torch.Tensor:
    """An exactly rank-`rank` float32 matrix with entries of rms DELTA_RMS."""
    g = _generator(*key, "delta")
    u = torch.randn((shape[0], rank), generator=g)
    v = torch.randn((rank, shape[1]), generator=g)
    return (u @ v).mul_(DELTA_RMS / rank**0.5)


def _stream(path: Path, specs: list[TensorSpec], tensors: Any) -> None:
    """Write bf16 tensors (an iterator, in `specs` order) into one safetensors file as they come."""
    with open(path, "wb") as fh:
        fh.write(_header(specs))
        for spec, tensor in zip(specs, tensors, strict=True):
            assert tuple(tensor.shape) == spec.shape and tensor.dtype == torch.bfloat16, spec
            _write_tensor(fh, tensor)


def _write_base_and_finetune(tmp: CommandModels, config: Any, size: CommandSize, key: tuple[object, ...]) -> None:
    """Both in one pass: each base tensor drawn once, the fine-tune's linear weights with a low-rank delta added."""
    specs = tensor_specs(config)
    with open(tmp.base / "model.safetensors", "wb") as base_fh, open(tmp.finetune / "model.safetensors", "wb") as ft_fh:
        base_fh.write(_header(specs))
        ft_fh.write(_header(specs))
        for spec in specs:
            base = _gaussian(spec.shape, *key, "base", spec.name).to(torch.bfloat16)
            _write_tensor(base_fh, base)
            if len(spec.shape) == 2 and spec.name not in (EMBED, HEAD):
                delta = _low_rank_delta(spec.shape, size.lora_rank, *key, spec.name)
                base = (base.float() + delta).to(torch.bfloat16)
            _write_tensor(ft_fh, base)


def _write_donor_and_truth(tmp: CommandModels, config: Any, size: CommandSize, words: dict[str, list[str]],
                           key: tuple[object, ...]) -> None:
    """The donor's tensors; its embedding's new rows are combinations of its shared rows (the module docstring)."""
    from safetensors.torch import save_file

    base_id = {w: i for i, w in enumerate(words["base"])}
    donor_words = words["donor"]
    shared_donor = torch.tensor([i for i, w in enumerate(donor_words) if w in base_id])
    shared_base = torch.tensor([base_id[donor_words[i]] for i in shared_donor.tolist()])
    new_donor = torch.tensor([i for i, w in enumerate(donor_words) if w not in base_id])
    g = _generator(*key, "mix")
    # `mix` distinct shared tokens per new one: sorted draws with repeats, the j-th moved up by j
    draws = torch.randint(0, shared_donor.numel() - size.mix + 1, (new_donor.numel(), size.mix), generator=g)
    pick = draws.sort(dim=1).values + torch.arange(size.mix)
    magnitude = torch.rand((new_donor.numel(), size.mix), generator=g) + 0.5
    sign = torch.randint(0, 2, magnitude.shape, generator=g) * 2 - 1
    coeffs = magnitude * sign

    specs = [s for s in tensor_specs(config) if s.name != HEAD]  # tied: the embedding is the head

    def tensors() -> Any:
        for spec in specs:
            if spec.name != EMBED:
                yield _gaussian(spec.shape, *key, "donor", spec.name).to(torch.bfloat16)
                continue
            embed = _gaussian(spec.shape, *key, "donor", spec.name).to(torch.bfloat16)
            atoms = embed[shared_donor].float()
            for start in range(0, new_donor.numel(), 4096):  # [rows, mix, hidden] a chunk at a time
                rows = slice(start, start + 4096)
                mixed = torch.bmm(coeffs[rows].unsqueeze(1), atoms[pick[rows]]).squeeze(1)
                embed[new_donor[rows]] = mixed.to(torch.bfloat16)
            yield embed

    _stream(tmp.donor / "model.safetensors", specs, tensors())
    save_file({"new_donor": new_donor, "shared_donor": shared_donor, "shared_base": shared_base,
               "mix_base": shared_base[pick], "mix_coeffs": coeffs.float()}, str(tmp.truth))
