"""Tokenizer merging end to end: vocabularies that really differ, built offline with `tokenizers`.

Three tiny llama models get word-level tokenizers over overlapping word lists in different orders,
so a shared word sits at a different id in each model. After a merge, the row of every output
token must be the documented combination of the input rows that held that word, whichever ids
they had; the merged tokenizer must round-trip text and load with transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mergesmith.config import parse_config
from mergesmith.engine.run import RunControls, build_plan, run_merge
from mergesmith.errors import CheckpointError, ConfigError
from mergesmith.tokenizer.templates import BUILTIN_TEMPLATES, resolve_chat_template
from tests.helpers import finite_logits, load_causal_lm, read_state_dict

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS_A = [*SPECIALS, "the", "cat", "sat", "on", "mat", "dog"]
WORDS_B = [*SPECIALS, "dog", "mat", "the", "bird", "flew", "cat", "away", "on"]
WORDS_C = [*SPECIALS, "bird", "on", "sat", "the", "cat", "mat", "dog"]
# B' puts the specials elsewhere, so a tokenizer taken from it moves bos/eos/pad ids.
WORDS_B_SHIFTED = ["the", "cat", *SPECIALS, "bird", "on", "sat", "mat", "dog"]

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def word_tokenizer(path: Path, words: list[str], chat_template: str | None = None) -> None:
    """A whitespace word-level tokenizer over `words` (id = position), saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))


@pytest.fixture(scope="module")
def vocab_models(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Models a, b, c (and b_shifted) whose tokenizers share words at different ids."""
    root = tmp_path_factory.mktemp("vocab_models")
    out = {}
    specs = {
        # the base holds the minority template, so `auto` taking the first (or the base's) is caught
        "a": (WORDS_A, 0, "{{ 'T2' }}"),
        "b": (WORDS_B, 1, "{{ 'T1' }}"),
        "c": (WORDS_C, 2, "{{ 'T1' }}"),
        "b_shifted": (WORDS_B_SHIFTED, 3, None),
    }
    for name, (words, seed, template) in specs.items():
        src = tiny_models("llama", seed=seed, layers=2, vocab_size=len(words), tokenizer=False)
        dst = root / name
        shutil.copytree(src, dst)
        word_tokenizer(dst, words, template)
        out[name] = dst
    return out


def _rows(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_state_dict(path).items() if k in (EMBED, HEAD)}


def _merge(config: dict[str, Any], out: Path) -> Any:
    return run_merge(parse_config(config), out, controls=RunControls(overwrite=True))


def _linear(models: dict[str, Path], names: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "merge_method": "linear",
        "base_model": str(models[names[0]]),
        "models": [{"model": str(models[n]), "parameters": {"weight": 1.0}} for n in names],
        "dtype": "float32",
        **extra,
    }


def test_union_rows_follow_the_default_fill_rules(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """Union of three vocabularies: each output token's row is the mean over models of the row each
    model contributes: its own, or (lacking the word) the donor's / the base's / the mean of holders."""
    from transformers import AutoTokenizer

    names = ["a", "b", "c"]
    result = _merge(_linear(vocab_models, names, tokenizer_source="union"), tmp_path / "out")
    out = tmp_path / "out"
    merged = _rows(out)
    inputs = {n: _rows(vocab_models[n]) for n in names}
    vocabs = {n: {w: i for i, w in enumerate(words)} for n, words in zip(names, (WORDS_A, WORDS_B, WORDS_C))}

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    vocab = tokenizer.get_vocab()
    union = list(dict.fromkeys(WORDS_A + WORDS_B + WORDS_C))
    assert set(vocab) == set(union)
    assert all(vocab[w] == i for i, w in enumerate(WORDS_A)), "the base's ids must not move"
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(union) == merged[EMBED].shape[0] == merged[HEAD].shape[0]

    for tensor in (EMBED, HEAD):
        for word in union:
            holders = [n for n in names if word in vocabs[n]]

            def row(n: str, w: str = word, t: str = tensor) -> torch.Tensor:
                return inputs[n][t][vocabs[n][w]]

            if len(holders) == 1:
                fill = row(holders[0])
            elif "a" in holders:
                fill = row("a")
            else:
                fill = torch.stack([row(n) for n in holders]).mean(0)
            contributed = [row(n) if n in holders else fill for n in names]
            expected = torch.stack(contributed).mean(0)
            torch.testing.assert_close(merged[tensor][vocab[word]], expected, msg=f"{tensor} row of {word!r}")

    text = "the bird flew away on the mat"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == text.split()
    assert tokenizer.decode(ids) == text
    model = load_causal_lm(out)
    finite_logits(model, [vocab[w] for w in ["<s>", "bird", "flew", "sat", "</s>"]])
    assert not result.plan.warnings


def test_tokens_section_sources_force_zero_and_padding(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """`tokenizer.tokens` rules (model, model_token by token and by id, zero, force, a new token) and
    `pad_to_multiple_of` rows set to the mean of the real rows."""
    names = ["a", "b", "c"]
    a, b, c = (str(vocab_models[n]) for n in names)
    tokens = {
        "sat": {"source": c, "force": True},
        "bird": {"source": {"kind": "model_token", "model": a, "token": "dog"}},
        "flew": {"source": {"kind": "zero"}},
        "away": {"source": {"kind": "model_token", "model": b, "token_id": 4}, "force": True},
        "<new>": {},
    }
    cfg = _linear(vocab_models, names, tokenizer={"source": "union", "tokens": tokens, "pad_to_multiple_of": 8})
    _merge(cfg, tmp_path / "out")
    out = tmp_path / "out"
    merged = _rows(out)[EMBED]
    ins = {n: _rows(vocab_models[n])[EMBED] for n in names}
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(out)).get_vocab()
    assert len(vocab) == 14 and "<new>" in vocab
    assert merged.shape[0] == 16 and json.loads((out / "config.json").read_text())["vocab_size"] == 16

    torch.testing.assert_close(merged[vocab["sat"]], ins["c"][WORDS_C.index("sat")])
    bird = (ins["a"][WORDS_A.index("dog")] + ins["b"][WORDS_B.index("bird")] + ins["c"][WORDS_C.index("bird")]) / 3
    torch.testing.assert_close(merged[vocab["bird"]], bird)
    torch.testing.assert_close(merged[vocab["flew"]], ins["b"][WORDS_B.index("flew")] / 3)
    torch.testing.assert_close(merged[vocab["away"]], ins["b"][4])
    assert torch.count_nonzero(merged[vocab["<new>"]]) == 0
    torch.testing.assert_close(merged[14], merged[:14].mean(0))
    torch.testing.assert_close(merged[15], merged[:14].mean(0))


def test_legacy_base_and_model_sources_reindex_rows(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """`tokenizer_source: base` keeps the base vocabulary; `tokenizer_source: <model>` takes that
    model's, moving the config's bos/eos/pad ids to where those tokens now sit."""
    a, b = _rows(vocab_models["a"])[EMBED], _rows(vocab_models["b"])[EMBED]
    _merge(_linear(vocab_models, ["a", "b"], tokenizer_source="base"), tmp_path / "base")
    merged = _rows(tmp_path / "base")[EMBED]
    assert merged.shape[0] == len(WORDS_A)
    for i, word in enumerate(WORDS_A):
        other = b[WORDS_B.index(word)] if word in WORDS_B else a[i]
        torch.testing.assert_close(merged[i], (a[i] + other) / 2, msg=word)

    shifted = str(vocab_models["b_shifted"])
    cfg = _linear(vocab_models, ["a", "b_shifted"], tokenizer_source=shifted)
    _merge(cfg, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["vocab_size"] == len(WORDS_B_SHIFTED)
    expected_ids = {k: WORDS_B_SHIFTED.index(t) for k, t in [("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>")]}
    assert {k: config[f"{k}_token_id"] for k in expected_ids} == expected_ids
    # generate() takes its ids from generation_config.json: moved there too, the rest kept
    from transformers import GenerationConfig

    base_generation = json.loads((vocab_models["a"] / "generation_config.json").read_text())
    assert {k: base_generation[f"{k}_token_id"] for k in expected_ids} != expected_ids
    generation = GenerationConfig.from_pretrained(str(tmp_path / "model"))
    assert {k: getattr(generation, f"{k}_token_id") for k in expected_ids} == expected_ids
    written = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    assert {k: v for k, v in written.items() if not k.endswith("_token_id")} == {
        k: v for k, v in base_generation.items() if not k.endswith("_token_id")
    }
    merged = _rows(tmp_path / "model")[EMBED]
    s = _rows(vocab_models["b_shifted"])[EMBED]
    for i, word in enumerate(WORDS_B_SHIFTED):
        own_a = a[WORDS_A.index(word)] if word in WORDS_A else s[i]
        torch.testing.assert_close(merged[i], (own_a + s[i]) / 2, msg=word)


def test_chat_templates_auto_builtin_inline(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """`auto` picks the most common input template; a name picks a built-in; an inline template is
    used as given; all are written where transformers reads them."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "the cat"}]
    _merge(_linear(vocab_models, ["a", "b", "c"], tokenizer_source="union", chat_template="auto"), tmp_path / "auto")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "auto")).apply_chat_template(messages, tokenize=False) == "T1"

    one_model = [{"model": str(vocab_models["a"])}]
    same_vocab = {"merge_method": "passthrough", "models": one_model, "chat_template": "chatml"}
    _merge(same_vocab, tmp_path / "chatml")
    rendered = AutoTokenizer.from_pretrained(str(tmp_path / "chatml")).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    saved = tmp_path / "chatml"
    assert (saved / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (saved / "tokenizer_config.json").read_text()
    )
    state = read_state_dict(tmp_path / "chatml")
    torch.testing.assert_close(state[EMBED], read_state_dict(vocab_models["a"])[EMBED])

    inline = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    _merge({**same_vocab, "chat_template": inline}, tmp_path / "inline")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "inline"))
    assert tok.apply_chat_template(messages, tokenize=False) == "[user]the cat"


def test_builtin_templates_render() -> None:
    """Every built-in template renders a short conversation with a generation prompt."""
    import jinja2

    env = jinja2.Environment()
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    for name, text in BUILTIN_TEMPLATES.items():
        out = env.from_string(text).render(
            messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True
        )
        assert "hi" in out and "hello" in out and "bye" in out and "be brief" in out, name
    assert resolve_chat_template("auto", [None, " x ", "y", "x"]) == "x"
    assert resolve_chat_template("auto", ["y", "x", "x"]) == "x"  # the most common, not the first
    assert resolve_chat_template("auto", ["y", "x"]) == "y"  # first seen on a tie
    assert resolve_chat_template("auto", [None]) is None
    with pytest.raises(ConfigError, match="unknown template 'vicuna-9'"):
        resolve_chat_template("vicuna-9", [])
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        resolve_chat_template("{% for x in %}", [])


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ({"cat": {"source": "/no/such/model"}}, "does not feed"),
        ({"cat": {"source": {"kind": "model_token", "model": "A", "token": "x", "token_id": 1}}}, "exactly one"),
        ({"cat": {"source": {"kind": "spline"}}}, "must be model_token or zero"),
        ({"cat": {"source": {"kind": "model_token", "model": "A", "token": "bird"}}}, "has no token 'bird'"),
        ({"cat": {"source": {"kind": "model_token", "model": "A", "token_id": 99}}}, "outside model"),
    ],
)
def test_tokens_section_errors(vocab_models: dict[str, Path], tokens: dict[str, Any], message: str) -> None:
    a = str(vocab_models["a"])
    tokens = json.loads(json.dumps(tokens).replace('"A"', json.dumps(a)))
    cfg = _linear(vocab_models, ["a", "b"], tokenizer={"tokens": tokens})
    with pytest.raises(ConfigError, match=message):
        build_plan(parse_config(cfg))


def test_base_without_tokenizer_is_one_line() -> None:
    """Vocabulary merging needs the base model's tokenizer; its absence is an input error, not a crash."""
    inputs = Path(__file__).parent / "reference" / "inputs"
    models = [{"model": str(inputs / "base")}, {"model": str(inputs / "ft_a")}]
    cfg = {"merge_method": "linear", "models": models, "parameters": {"weight": 1.0}, "tokenizer_source": "union"}
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        build_plan(parse_config(cfg))


def test_plan_is_deterministic_and_reruns_resume(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """Two plannings of a union merge give one fingerprint, so a rerun finds the merge complete."""
    cfg = parse_config(_linear(vocab_models, ["a", "b", "c"], tokenizer={"source": "union", "pad_to_multiple_of": 4}))
    first, _ = build_plan(cfg)
    second, _ = build_plan(cfg)
    assert first.fingerprint() == second.fingerprint()
    assert run_merge(cfg, tmp_path / "out").already_complete is False
    assert run_merge(cfg, tmp_path / "out").already_complete is True


def test_plain_merge_does_not_import_transformers() -> None:
    """The tokenizer step is lazy: planning a merge without tokenizer keys never loads transformers."""
    inputs = Path(__file__).parent / "reference" / "inputs"
    code = (
        "import sys\n"
        "from mergesmith.engine.run import build_plan\n"
        "from mergesmith.config import parse_config\n"
        f"models = [{{'model': {str(inputs / 'base')!r}}}, {{'model': {str(inputs / 'ft_a')!r}}}]\n"
        "cfg = parse_config({'merge_method': 'linear', 'models': models, 'parameters': {'weight': 1.0}})\n"
        "build_plan(cfg)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


MERGEKIT_VENV = Path(os.environ.get("MERGEKIT_VENV", Path.home() / ".cache" / "mergesmith" / "mergekit-venv"))


@pytest.mark.slow
@pytest.mark.skipif(not (MERGEKIT_VENV / "bin" / "mergekit-yaml").exists(), reason="no mergekit venv")
def test_rows_match_mergekit(vocab_models: dict[str, Path], tmp_path: Path) -> None:
    """The `tokens` merge above, run by mergekit 0.1.5 too: every token's row agrees (compared by
    token, since mergekit numbers union tokens in hash order), padding rows included."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    a, b, c = (str(vocab_models[n]) for n in ("a", "b", "c"))
    tokens = {
        "sat": {"source": c, "force": True},
        "bird": {"source": {"kind": "model_token", "model": a, "token": "dog"}},
        "flew": {"source": {"kind": "zero"}},
        "away": {"source": {"kind": "model_token", "model": b, "token_id": 4}, "force": True},
    }
    section = {"source": "union", "tokens": tokens, "pad_to_multiple_of": 8}
    cfg = _linear(vocab_models, ["a", "b", "c"], tokenizer=section)
    (tmp_path / "config.yml").write_text(json.dumps(cfg))
    subprocess.run(
        [str(MERGEKIT_VENV / "bin" / "mergekit-yaml"), str(tmp_path / "config.yml"), str(tmp_path / "mk")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    _merge(cfg, tmp_path / "ms")
    ours, theirs = load_file(tmp_path / "ms" / "model.safetensors"), load_file(tmp_path / "mk" / "model.safetensors")
    vocab_ours = AutoTokenizer.from_pretrained(str(tmp_path / "ms")).get_vocab()
    vocab_theirs = AutoTokenizer.from_pretrained(str(tmp_path / "mk")).get_vocab()
    assert set(vocab_ours) == set(vocab_theirs)
    for tensor in (EMBED, HEAD):
        assert ours[tensor].shape == theirs[tensor].shape
        for tok, i in vocab_ours.items():
            torch.testing.assert_close(ours[tensor][i], theirs[tensor][vocab_theirs[tok]], msg=f"{tensor} {tok!r}")
        torch.testing.assert_close(ours[tensor][len(vocab_ours) :], theirs[tensor][len(vocab_theirs) :])
    for name in theirs.keys() - {EMBED, HEAD}:
        torch.testing.assert_close(ours[name], theirs[name], msg=name)
