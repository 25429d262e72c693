"""Build tiny skill models: a llama base and one short fine-tune per skill, for the evolve proof and the skills bench.

    python examples/evolve_skills/make_fixtures.py tests/fixtures/evolve             # two skills (evolve proof)
    python examples/evolve_skills/make_fixtures.py --skills4 tests/fixtures/skills4  # four skills (skills bench)
    python examples/evolve_skills/make_fixtures.py --skills4 --check tests/fixtures/skills4  # rebuild, compare

Both recipes share the method; they differ in the skills, the model's size and the step counts (RECIPES):

- a character-level tokenizer built with the `tokenizers` library (the recipe's characters and specials);
- `base`: a small llama trained on a mix of all the skills and stopped half way through learning them (a
  constant learning rate after a short warm-up: it knows every format and is mediocre at each);
- one fine-tune per skill, named after it: the base trained on that skill only, briefly (a one-cycle schedule)
  and at a small learning rate, so that each task vector is a small delta from the base;
- `<skill>_eval.jsonl`: held-out prompts and answers per skill (never trained on);
- `skills4` only: `calibration.txt`, training-distribution examples (prompt and answer, one a line, the skills
  interleaved, none held out) for methods that need data (RegMean's Gram matrices).

The skills: `add` adds a digit to a two-digit number ("37+5=" -> "42"); `rev` reverses a short string
("abcde>" -> "edcba"); `sort` sorts a string's letters ("dbca:" -> "abcd"); `next` replaces each letter by the
next one, j wrapping to a ("abj^" -> "bca"). The three letter skills read the same kind of input and map it
differently, so their fine-tunes pull the same weights different ways: a merge has interference to resolve.

`evolve` (two skills, 4 layers, hidden 48): fine-tunes of 60 steps at 3e-4, so both added at full weight keep
much of both skills, which a merge search can find and a 50/50 average cannot (the README's evolve section).
`skills4` (four skills, 4 layers, hidden 32, 42 k parameters): a base of 400 steps (3:1:1:1, addition the
slowest again) and fine-tunes of 60 steps at 5e-4, enough that each fine-tune forgets some of the other skills
and task vectors added at full weight collide (bench/skills_table.py; the README's "Which method keeps the most
skills"); the five models take 478 KB. Models are saved in bfloat16; training takes one CPU thread (evolve
16 s, skills4 23 s on a shared 2-core machine; scoring every model one prompt at a time adds about as much).
Deterministic: one seed, one torch thread; `--check` rebuilds into a temporary folder and compares every
file's sha256 with the given folder's (exit 1 on a difference).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
SEED = 1234
EVAL_SIZE = 150
BATCH = 128
LETTERS = "abcdefghij"

Maker = Callable[[random.Random], tuple[str, str]]


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(0, 9)
    return f"{a}+{b}=", str(a + b)


def _letters(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 7)))


def reverse(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"{s}>", s[::-1]


def sort_letters(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"{s}:", "".join(sorted(s))


def next_letter(rng: random.Random) -> tuple[str, str]:
    s = _letters(rng)
    return f"{s}^", "".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in s)


@dataclass(frozen=True)
class Skill:
    name: str  # the fine-tune's folder and its eval file's prefix
    make: Maker
    share: int  # its count in the base's training mix


@dataclass(frozen=True)
class Recipe:
    chars: str
    skills: tuple[Skill, ...]
    hidden: int
    intermediate: int
    layers: int
    heads: int
    base_steps: int  # stopped half way: more steps and the base has the skills already, fewer and it has none
    base_lr: float
    tune_steps: int
    tune_lr: float  # small fine-tunes stay near the base, where task vectors add up
    calibration: int = 0  # training examples per skill in calibration.txt (0: no file)


RECIPES = {
    # addition is the slower skill to learn: 3 of every 4 base examples
    "evolve": Recipe(
        chars="0123456789abcdefghij+=>", skills=(Skill("add", addition, 3), Skill("rev", reverse, 1)),
        hidden=48, intermediate=96, layers=4, heads=4, base_steps=275, base_lr=3e-3, tune_steps=60, tune_lr=3e-4,
    ),
    "skills4": Recipe(
        chars="0123456789abcdefghij+=>:^",
        skills=(Skill("add", addition, 3), Skill("rev", reverse, 1), Skill("sort", sort_letters, 1),
                Skill("next", next_letter, 1)),
        hidden=32, intermediate=64, layers=4, heads=4, base_steps=400, base_lr=3e-3, tune_steps=60, tune_lr=5e-4,
        calibration=64,
    ),
}


def build_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def held_out(make: Maker, rng: random.Random) -> list[tuple[str, str]]:
    seen, out = set(), []
    while len(out) < EVAL_SIZE:
        p, a = make(rng)
        if p not in seen:
            seen.add(p)
            out.append((p, a))
    return out


def batch(tok, makers, held: set[str], rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = tok.get_vocab()  # one id per character: encoding by hand is much faster than calling the tokenizer
    rows = []
    while len(rows) < size:
        p, a = rng.choice(makers)(rng)
        if p in held:
            continue
        ids = [tok.bos_token_id] + [vocab[c] for c in p + a] + [tok.eos_token_id]
        rows.append((ids, 1 + len(p)))
    width = max(len(r) for r, _ in rows)
    ids = torch.full((size, width), tok.pad_token_id)
    labels = torch.full((size, width), -100)
    for i, (r, n) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, n : len(r)] = torch.tensor(r[n:])  # loss on the answer and </s> only
    return ids, labels


def train(model, tok, makers, held, steps: int, lr: float, seed: int, one_cycle: bool) -> None:
    """AdamW on the answers' tokens: a one-cycle schedule for the fine-tunes; a constant rate after a short
    warm-up for the base, so that where it stops does not depend on where a schedule ends."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if one_cycle:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    model.train()
    for step in range(steps):
        ids, labels = batch(tok, makers, held, rng, BATCH)
        # right padding only, and the loss ignores it: causal attention needs no mask here
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def accuracy(model, tok, pairs) -> float:
    """Exact match of greedy generation, one prompt at a time (what the evolve fixtures' numbers were made with)."""
    ok = 0
    with torch.inference_mode():
        for p, a in pairs:
            ids = torch.tensor([tok(p)["input_ids"]])
            out = model.generate(ids, max_new_tokens=len(a) + 2, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            ok += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == a
    return ok / len(pairs)


def _portable_tokenizer_config(path: Path) -> None:
    """Name the generic fast-tokenizer class (transformers 5 writes its own backend's name, unknown to 4.x)."""
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _calibration(recipe: Recipe, held: set[str]) -> str:
    """Lines of training-distribution text (prompt + answer, never a held-out prompt), the skills interleaved."""
    rng = random.Random(SEED + 1)
    lines = []
    for _ in range(recipe.calibration):
        for skill in recipe.skills:
            p, a = skill.make(rng)
            while p in held:
                p, a = skill.make(rng)
            lines.append(p + a)
    return "".join(line + "\n" for line in lines)


def build(out: Path, recipe: Recipe, score: bool = True) -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # the CPU is shared; more threads do not help a model this small
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(recipe.chars)
    rng = random.Random(SEED)
    evals = {s.name: held_out(s.make, rng) for s in recipe.skills}
    held = {p for pairs in evals.values() for p, _ in pairs}
    for name, pairs in evals.items():
        records = "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs)
        (out / f"{name}_eval.jsonl").write_text(records)
    if recipe.calibration:
        (out / "calibration.txt").write_text(_calibration(recipe, held))
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(recipe.chars), hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate, num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads, max_position_embeddings=32, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    base = LlamaForCausalLM(config)
    print(f"base: {len(recipe.skills)} skills", flush=True)
    mix = [s.make for s in recipe.skills for _ in range(s.share)]
    train(base, tok, mix, held, steps=recipe.base_steps, lr=recipe.base_lr, seed=1, one_cycle=False)
    results = {}
    for i, skill in enumerate(recipe.skills):
        model = LlamaForCausalLM(config)
        model.load_state_dict(base.state_dict())
        print(f"{skill.name}: fine-tune", flush=True)
        train(model, tok, [skill.make], held, steps=recipe.tune_steps, lr=recipe.tune_lr, seed=2 + i, one_cycle=True)
        results[skill.name] = model
    results["base"] = base
    for name, model in results.items():
        model.to(torch.bfloat16).save_pretrained(out / name)
        tok.save_pretrained(out / name)
        _portable_tokenizer_config(out / name / "tokenizer_config.json")
        if score:
            model.float()
            accs = " ".join(f"{s}: {accuracy(model, tok, pairs):.3f}" for s, pairs in evals.items())
            print(f"{name}: {accs}", flush=True)
    print(f"done in {time.time() - started:.0f} s")


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (README.md aside: it is written by hand), by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "README.md"
    }


def check(folder: Path, recipe: Recipe) -> list[str]:
    """Rebuild `recipe` in a temporary folder; the files whose bytes differ from `folder`'s (or miss on a side)."""
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), recipe, score=False)
        new = digests(Path(tmp))
    old = digests(folder)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="fixture folder (default tests/fixtures/<recipe>)")
    parser.add_argument("--skills4", action="store_true", help="the four-skill recipe (default: two skills)")
    parser.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare sha256s")
    args = parser.parse_args(argv)
    name = "skills4" if args.skills4 else "evolve"
    out = args.out or Path("tests/fixtures") / name
    if not args.check:
        build(out, RECIPES[name])
        return 0
    differ = check(out, RECIPES[name])
    for path in differ:
        print(f"differs: {path}")
    print("identical" if not differ else f"{len(differ)} files differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
