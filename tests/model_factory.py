"""Factory of tiny, real, random-init Hugging Face checkpoints for end-to-end tests.

Every end-to-end test of mergesmith needs checkpoints that look exactly like the ones users merge: a
``config.json`` from a real transformers config class, a ``generation_config.json``, weights under the real
tensor names in one of the on-disk layouts the loader must read, and a tokenizer beside them. Downloading real
models is impossible here (no hub, two CPU cores), so this module builds them from scratch: a few hundred KB each,
deterministic per seed, and loadable by ``AutoModelForCausalLM.from_pretrained`` with no missing or unexpected keys.

Facts about transformers 5.x that shape this module (checked against 5.23):

* ``save_pretrained`` always writes safetensors; the old ``safe_serialization=False`` is swallowed by ``**kwargs``
  and ignored. ``.bin`` checkpoints are therefore produced by saving safetensors and re-writing each file with
  ``torch.save`` (same keys, same tied-weight removal, same shard split), renaming the index to
  ``pytorch_model.bin.index.json``. ``from_pretrained`` still loads such ``.bin`` checkpoints.
* Tied embeddings are dropped at save time: ``qwen2`` (with ``tie_word_embeddings=True``) and every gemma model
  (tied by default) have no ``lm_head.weight`` on disk.
* ``phi3`` stores fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` weights; nothing splits them on load.
* The config records the dtype under ``dtype`` (not ``torch_dtype``), and ``from_pretrained`` loads in that dtype.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

# Progress bars from save/load are pure noise in test logs.
transformers.utils.logging.disable_progress_bar()

FORMATS: tuple[str, ...] = ("safetensors", "bin", "sharded", "sharded_bin")
"""On-disk layouts: one ``model.safetensors``; one ``pytorch_model.bin``; several safetensors shards with
``model.safetensors.index.json``; several ``.bin`` shards with ``pytorch_model.bin.index.json``."""

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
"""Token ids 0..3 in every tiny tokenizer; the configs use the same ids for pad/bos/eos."""
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# Shared by every architecture: small enough that a 4-layer fp32 model is ~200 KB, big enough that GQA
# (4 query heads over 2 kv heads) and head_dim > 1 are exercised.
_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Every third layer full attention, so a 4-layer model has a non-periodic-by-2 list (s, s, f, s).

    The transformers default (every sixth) would make a tiny model all-sliding, which hides slicing bugs.
    """
    return ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)]


@dataclass(frozen=True)
class ArchSpec:
    """How to build one architecture: config class, its tiny defaults, and facts tests may rely on."""

    config_cls: type[PretrainedConfig]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    tied: bool = False
    """Whether ``lm_head.weight`` is tied to ``model.embed_tokens.weight`` (and so absent from disk)."""
    explicit_head_dim: bool = False
    """Gemma configs default ``head_dim`` to 256 instead of deriving it, so it must be set from hidden/heads."""
    layer_types: Callable[[int], list[str]] | None = None
    """Builds ``layer_types`` explicitly; ``None`` lets the config derive it (or not have one)."""
    common: Mapping[str, Any] | None = None
    """Replaces the shared tiny sizes where the config class names them differently (gpt2's ``n_embd``, mamba)."""
    model_cls: str | None = None
    """The transformers class to build and load with, where ``AutoModelForCausalLM`` does not know the config
    (vision-language models)."""
    text_config: bool = False
    """The layer count, vocabulary and token ids live in ``text_config`` (vision-language models)."""


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(transformers.LlamaConfig),
    # sliding_window=None as in Mistral v0.2+; the v0.1 default of 4096 is meaningless with 128 positions.
    "mistral": ArchSpec(transformers.MistralConfig, {"sliding_window": None}),
    # Qwen2 has q/k/v biases and derives layer_types ("full_attention" x layers).
    "qwen2": ArchSpec(transformers.Qwen2Config, {"tie_word_embeddings": True}, tied=True),
    "phi3": ArchSpec(transformers.Phi3Config),
    "gemma": ArchSpec(transformers.GemmaConfig, tied=True, explicit_head_dim=True),
    # Gemma2 derives layer_types alternating sliding/full, starting with sliding.
    "gemma2": ArchSpec(transformers.Gemma2Config, {"sliding_window": 16}, tied=True, explicit_head_dim=True),
    "gemma3": ArchSpec(
        transformers.Gemma3TextConfig,
        {"sliding_window": 16},
        tied=True,
        explicit_head_dim=True,
        layer_types=_gemma3_layer_types,
    ),
}
"""Architectures the factory builds. ``gemma3`` is the text-only ``Gemma3ForCausalLM`` (model_type ``gemma3_text``)."""


_VISION_CLIP: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 3,  # deeper than the 2-layer text stacks the tests use, so the stacks differ in depth
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 8,
}
_VISION_QWEN2VL: dict[str, Any] = {
    "depth": 3,
    "embed_dim": 16,
    "hidden_size": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

MORE_ARCHS: dict[str, ArchSpec] = {
    "qwen3": ArchSpec(transformers.Qwen3Config, {"head_dim": 8}),
    "phi": ArchSpec(transformers.PhiConfig),  # phi-2: dense + fc1/fc2 MLP, biases, lm_head.bias, final_layernorm
    # GPT-2 stores Conv1D weights as [in, out] and ties its head to transformer.wte.
    "gpt2": ArchSpec(
        transformers.GPT2Config,
        tied=True,
        common={
            "vocab_size": 256,
            "n_embd": 32,
            "n_head": 4,
            "n_positions": 128,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
        },
    ),
    "granite": ArchSpec(transformers.GraniteConfig),
    "olmo2": ArchSpec(transformers.Olmo2Config),
    "cohere": ArchSpec(transformers.CohereConfig),
    "starcoder2": ArchSpec(transformers.Starcoder2Config, {"sliding_window": None}),
    "mixtral": ArchSpec(transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Layer 0 dense (mlp_only_layers), the others sparse: slicing must re-index that list of layer indices.
    "qwen2_moe": ArchSpec(
        transformers.Qwen2MoeConfig,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [0],
        },
    ),
    # Multi-latent attention; the first layer dense (first_k_dense_replace), the rest mixture-of-experts.
    "deepseek_v3": ArchSpec(
        transformers.DeepseekV3Config,
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "mamba": ArchSpec(
        transformers.MambaConfig,
        tied=True,
        common={
            "vocab_size": 256,
            "hidden_size": 32,
            "state_size": 4,
            "expand": 2,
            "conv_kernel": 4,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        },
    ),
    "llava": ArchSpec(
        transformers.LlavaConfig,
        {"vision_config": _VISION_CLIP, "image_token_index": 250},
        model_cls="LlavaForConditionalGeneration",
        text_config=True,
        common={"model_type": "llama", **_COMMON},
    ),
    "qwen2_vl": ArchSpec(
        transformers.Qwen2VLConfig,
        {"vision_config": _VISION_QWEN2VL, "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252},
        model_cls="Qwen2VLForConditionalGeneration",
        text_config=True,
        # mrope_section splits head_dim / 2 = 4 rotary frequencies over (time, height, width)
        common={
            "model_type": "qwen2_vl_text",
            **_COMMON,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
        },
    ),
}
"""Further architectures, built by the architecture tests (tests/test_architectures.py) at 2 layers; kept apart
from ARCHS so the layout tests of every core architecture in every format do not multiply."""


def arch_spec(arch: str) -> ArchSpec:
    """The spec of ``arch`` from ARCHS or MORE_ARCHS."""
    spec = ARCHS.get(arch) or MORE_ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted({*ARCHS, *MORE_ARCHS})}")
    return spec


def model_class(arch: str) -> Any:
    """The class that builds and loads ``arch``: AutoModelForCausalLM, or the model's own class."""
    spec = arch_spec(arch)
    return getattr(transformers, spec.model_cls) if spec.model_cls else AutoModelForCausalLM


def tiny_config(
    arch: str, *, layers: int = 4, dtype: torch.dtype = torch.float32, **overrides: Any
) -> PretrainedConfig:
    """Return the tiny config for ``arch``; ``overrides`` are config kwargs applied last.

    Derived values (``head_dim``, ``query_pre_attn_scalar``, gemma3 ``layer_types``) are recomputed from the
    overridden sizes unless overridden themselves, so e.g. ``hidden_size=64`` or ``layers=2`` stays consistent.
    """
    spec = arch_spec(arch)
    common = _COMMON if spec.common is None else spec.common
    if spec.text_config:
        text = {**common, "num_hidden_layers": layers, **overrides.pop("text_config", {})}
        kwargs: dict[str, Any] = {**spec.defaults, "text_config": text, **overrides}
        config = spec.config_cls(**kwargs)
        config.dtype = dtype
        return config
    layer_key = "n_layer" if "n_embd" in common else "num_hidden_layers"
    kwargs = {**common, **spec.defaults, layer_key: layers, **overrides}
    if spec.explicit_head_dim:
        head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        kwargs.setdefault("head_dim", head_dim)
        kwargs.setdefault("query_pre_attn_scalar", kwargs["head_dim"])
    if spec.layer_types is not None:
        kwargs.setdefault("layer_types", spec.layer_types(kwargs["num_hidden_layers"]))
    config = spec.config_cls(**kwargs)
    config.dtype = dtype
    return config


def tokenizer_vocab(vocab_size: int, added_tokens: Sequence[str] = ()) -> list[str]:
    """Tokens by id: the specials, then ``tok4``, ``tok5``, ..., with ``added_tokens`` taking the last ids.

    Independent of the model seed, so models built with the same ``vocab_size`` share one tokenizer (as real
    fine-tunes of one base do); ``added_tokens`` makes two otherwise identical vocabularies differ.
    """
    fillers = vocab_size - len(SPECIAL_TOKENS) - len(added_tokens)
    if fillers < 0:
        raise ValueError(f"vocab_size={vocab_size} too small for specials plus {len(added_tokens)} added tokens")
    vocab = [*SPECIAL_TOKENS, *(f"tok{i}" for i in range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + fillers))]
    vocab.extend(added_tokens)
    if len(set(vocab)) != len(vocab):
        raise ValueError(f"added_tokens {list(added_tokens)} collide with the base vocabulary")
    return vocab


def make_tokenizer(
    path: Path,
    vocab_size: int,
    *,
    added_tokens: Sequence[str] = (),
    model_max_length: int = 128,
    chat_template: str | None = None,
) -> Path:
    """Build a word-level tokenizer over :func:`tokenizer_vocab` offline and ``save_pretrained`` it into ``path``.

    Word-level over whitespace keeps it trivial and exact: ``"tok5 tok6"`` encodes to ``[5, 6]``. In
    transformers 5 ``PreTrainedTokenizerFast`` is ``TokenizersBackend``; it writes ``tokenizer.json`` and
    ``tokenizer_config.json`` (no ``special_tokens_map.json``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = tokenizer_vocab(vocab_size, added_tokens)
    backend = Tokenizer(models.WordLevel(vocab={tok: i for i, tok in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path


def _shard_size_for(model: PreTrainedModel) -> int:
    """A ``max_shard_size`` that splits the model into about four shards (never below the largest tensor)."""
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]
    return max(max(sizes), sum(sizes) // 4)


def _safetensors_to_bin(path: Path) -> None:
    """Rewrite the safetensors weights in ``path`` as ``.bin`` files with the names transformers used in v4.

    Loading with safetensors and saving with ``torch.save`` keeps the exact keys and shard split that
    ``save_pretrained`` chose (including tied-weight removal).
    """
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        renames = {
            name: name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            for name in set(data["weight_map"].values())
        }
        for src, dst in sorted(renames.items()):
            torch.save(load_file(path / src), path / dst)
            (path / src).unlink()
        data["weight_map"] = {key: renames[file] for key, file in data["weight_map"].items()}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        index.unlink()
    else:
        torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()


def save_model(model: PreTrainedModel, path: Path, fmt: str = "safetensors") -> Path:
    """Save ``model`` into ``path`` in layout ``fmt`` (see :data:`FORMATS`), replacing any weights there."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown fmt {fmt!r}; expected one of {FORMATS}")
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.index.json")]:
        stale.unlink()
    sharded = fmt in ("sharded", "sharded_bin")
    max_shard_size = _shard_size_for(model) if sharded else "50GB"
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    if sharded and not (path / "model.safetensors.index.json").exists():
        raise AssertionError(f"save_pretrained did not shard with max_shard_size={max_shard_size}")
    if fmt in ("bin", "sharded_bin"):
        _safetensors_to_bin(path)
    return path


def _jitter_constant_tensors(model: PreTrainedModel, std: float, generator: torch.Generator) -> None:
    """Add noise to tensors that random init leaves constant (norm weights at 1 or 0, biases at 0).

    Otherwise every seed shares those tensors exactly, and merge methods that treat agreement specially (TIES
    sign election, DARE, model stock, ...) would be tested on degenerate inputs real checkpoints never have.
    """
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.add_(noise.to(param.dtype))


def make_model(
    arch: str,
    path: Path,
    *,
    seed: int,
    layers: int = 4,
    fmt: str = "safetensors",
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    added_tokens: Sequence[str] = (),
    chat_template: str | None = None,
    jitter: float = 0.02,
    **overrides: Any,
) -> Path:
    """Build a tiny random-init ``arch`` model with ``seed`` and save it (plus a tokenizer) into ``path``.

    The model is initialised in float32 under ``seed`` and then cast, so a bf16 build is the rounding of the fp32
    build with the same seed. ``jitter`` (std; 0 disables) perturbs tensors init leaves constant. The global
    torch RNG is restored afterwards so building models does not change the randomness of the calling test.
    ``overrides`` go to the config (see :func:`tiny_config`). Returns ``path``.
    """
    config = tiny_config(arch, layers=layers, dtype=dtype, **overrides)
    text = config.get_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cls = model_class(arch)
        model = (
            cls.from_config(config, dtype=torch.float32)
            if cls is AutoModelForCausalLM
            else cls._from_config(config, dtype=torch.float32)
        )
        if jitter:
            _jitter_constant_tensors(model, jitter, torch.Generator().manual_seed(seed + 1_000_003))
    model = model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    save_model(model, path, fmt)
    if tokenizer:
        make_tokenizer(
            path,
            text.vocab_size,
            added_tokens=added_tokens,
            model_max_length=getattr(text, "max_position_embeddings", 128),
            chat_template=chat_template,
        )
    return path


def derive_model(
    base: Path,
    path: Path,
    *,
    seed: int,
    scale: float = 0.01,
    fmt: str = "safetensors",
    tokenizer: bool = True,
) -> Path:
    """Save a "fine-tune" of the checkpoint at ``base``: every parameter plus N(0, ``scale``) noise under ``seed``.

    Task-arithmetic style methods (task_arithmetic, TIES, DARE, DELLA, breadcrumbs, model_stock) need models that
    share a base and differ by small deltas, which independent seeds do not give. Tied weights stay tied (the
    shared parameter is perturbed once). The base tokenizer files are copied when ``tokenizer`` is true.
    """
    archs = json.loads((base / "config.json").read_text()).get("architectures") or []
    cls = getattr(transformers, archs[0]) if archs and "ForConditionalGeneration" in archs[0] else AutoModelForCausalLM
    model = cls.from_pretrained(str(base))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale
            param.add_(noise.to(param.dtype))
    model.eval()
    save_model(model, path, fmt)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (base / name).exists():
                shutil.copy2(base / name, path / name)
    return path


def _cache_dirname(kind: str, key: Mapping[str, Any]) -> str:
    """Readable-but-unique directory name for a cache entry, e.g. ``llama-s0-safetensors-1a2b3c4d5e``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:10]
    label = "-".join(str(key[k]) for k in ("arch", "seed", "fmt") if k in key)
    return f"{kind}-{label}-{digest}".replace("/", "_")


class ModelCache:
    """Builds each distinct tiny model once under ``root`` and hands out its path on later requests.

    Tests share these directories, so they must treat them as read-only (copy with ``shutil.copytree`` first to
    mutate). The cache key is every argument, so any difference in arch/seed/fmt/layers/dtype/overrides builds a
    separate model.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="tiny_models-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._built: dict[str, Path] = {}

    def __call__(
        self,
        arch: str,
        *,
        seed: int = 0,
        layers: int = 4,
        fmt: str = "safetensors",
        dtype: torch.dtype = torch.float32,
        tokenizer: bool = True,
        added_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        jitter: float = 0.02,
        **overrides: Any,
    ) -> Path:
        """Path of the model :func:`make_model` builds from these arguments, building it on first request."""
        key = {
            "arch": arch,
            "seed": seed,
            "layers": layers,
            "fmt": fmt,
            "dtype": str(dtype),
            "tokenizer": tokenizer,
            "added_tokens": list(added_tokens),
            "chat_template": chat_template,
            "jitter": jitter,
            "overrides": {k: repr(v) for k, v in sorted(overrides.items())},
        }
        name = _cache_dirname("model", key)
        if name not in self._built:
            path = self.root / name
            shutil.rmtree(path, ignore_errors=True)
            make_model(
                arch,
                path,
                seed=seed,
                layers=layers,
                fmt=fmt,
                dtype=dtype,
                tokenizer=tokenizer,
                added_tokens=added_tokens,
                chat_template=chat_template,
                jitter=jitter,
                **overrides,
            )
            self._built[name] = path
        return self._built[name]

    def derive(
        self, base: Path, *, seed: int, scale: float = 0.01, fmt: str = "safetensors", tokenizer: bool = True
    ) -> Path:
        """Path of :func:`derive_model` applied to ``base`` with these arguments, building it on first request."""
        key = {"base": str(base), "seed": seed, "scale": scale, "fmt": fmt, "tokenizer": tokenizer}
        name = _cache_dirname("derived", key)
        if name not in self._built:
            path = self.root / name
            shutil.rmtree(path, ignore_errors=True)
            derive_model(base, path, seed=seed, scale=scale, fmt=fmt, tokenizer=tokenizer)
            self._built[name] = path
        return self._built[name]


def make_sentencepiece_tokenizer(path: Path, vocab_size: int = 256, *, seed: int = 0) -> Path:
    """Train a SentencePiece BPE ``tokenizer.model`` offline and save it beside its ``tokenizer.json`` in ``path``.

    The layout of Llama-2, Gemma and Phi-3 repositories, which llama.cpp's ``convert_hf_to_gguf.py`` reads
    through ``sentencepiece`` (it rejects the word-level tokenizer of :func:`make_tokenizer`: unknown
    pre-tokenizer). Ids 0-3 are ``<pad> <s> </s> <unk>`` as in every tiny model; the corpus is random letter
    words, rich enough that BPE reaches exactly ``vocab_size`` pieces. ``tokenizer.json`` is transformers'
    own conversion (``LlamaTokenizer``). Takes about 0.1 s; the model file is about 3 KB.
    """
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        character_coverage=1.0,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "tokenizer.model").write_bytes(model.getvalue())
        tokenizer = transformers.LlamaTokenizer.from_pretrained(scratch, pad_token="<pad>")
    if len(tokenizer) != vocab_size:
        raise AssertionError(f"SentencePiece tokenizer has {len(tokenizer)} tokens, wanted {vocab_size}")
    tokenizer.save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("vocab_file", None)  # the scratch directory's path
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (path / "tokenizer.model").write_bytes(model.getvalue())
    return path
