"""Build the evolve proof's fixtures: a tiny llama base and two fine-tunes on different skills.

    python examples/evolve_skills/make_fixtures.py tests/fixtures/evolve

- a character-level tokenizer built with the `tokenizers` library (digits, a-j, `+ = >`, specials);
- `base`: a 4-layer llama (hidden 48) trained on a 3:1 mix of both skills and stopped half way through
  learning them (275 steps at a constant learning rate: it knows both formats and is mediocre at both);
- `add`: base fine-tuned on adding a digit to a two-digit number only ("37+5=" -> "42");
- `rev`: base fine-tuned on reversing a short string only ("abcde>" -> "edcba");
- `add_eval.jsonl`, `rev_eval.jsonl`: held-out prompts and answers (never trained on).
The fine-tunes are short (60 steps) with a small learning rate (3e-4), so each task vector is a small delta
from the base: both added at full weight keep much of both skills, which a merge search can find and a
50/50 average (half of each delta) cannot. Measured accuracies: the README's evolve section.
Models are saved in bfloat16 so the three fit in a few hundred KB; training takes under a minute of one
CPU thread. Deterministic: one seed, one torch thread.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789abcdefghij+=>")
SEED = 1234
EVAL_SIZE = 150
BATCH = 128
BASE_STEPS = 275  # stopped half way: more steps and the base has both skills already, fewer and it has neither
BASE_LR = 3e-3
BASE_MIX = (3, 1)  # addition is the slower skill to learn
TUNE_STEPS = 60
TUNE_LR = 3e-4  # small fine-tunes stay near the base, where task vectors add up


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(0, 9)
    return f"{a}+{b}=", str(a + b)


def reverse(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(4, 7)))
    return f"{s}>", s[::-1]


def held_out(make, rng: random.Random) -> list[tuple[str, str]]:
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


def main(out: Path) -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # the CPU is shared; more threads do not help a model this small
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    rng = random.Random(SEED)
    add_eval, rev_eval = held_out(addition, rng), held_out(reverse, rng)
    held = {p for p, _ in add_eval + rev_eval}
    for name, pairs in (("add_eval.jsonl", add_eval), ("rev_eval.jsonl", rev_eval)):
        (out / name).write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs))
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(CHARS), hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    base = LlamaForCausalLM(config)
    print("base: both skills", flush=True)
    mix = [addition] * BASE_MIX[0] + [reverse] * BASE_MIX[1]
    train(base, tok, mix, held, steps=BASE_STEPS, lr=BASE_LR, seed=1, one_cycle=False)
    results = {}
    for name, makers, steps, seed in (("add", [addition], TUNE_STEPS, 2), ("rev", [reverse], TUNE_STEPS, 3)):
        model = LlamaForCausalLM(config)
        model.load_state_dict(base.state_dict())
        print(f"{name}: fine-tune", flush=True)
        train(model, tok, makers, held, steps=steps, lr=TUNE_LR, seed=seed, one_cycle=True)
        results[name] = model
    results["base"] = base
    for name, model in results.items():
        model.to(torch.bfloat16).save_pretrained(out / name)
        tok.save_pretrained(out / name)
        _portable_tokenizer_config(out / name / "tokenizer_config.json")
        model.float()
        print(f"{name}: add {accuracy(model, tok, add_eval):.3f} rev {accuracy(model, tok, rev_eval):.3f}", flush=True)
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/evolve"))
