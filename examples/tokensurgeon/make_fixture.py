"""Build the tokensurgeon proof fixture: two BPE tokenizers and two tiny llamas trained on one corpus.

    PYTHONPATH=examples/tokensurgeon python examples/tokensurgeon/make_fixture.py OUT [--minutes 4 | --steps 424 630]

- tokenizer A: byte-level BPE with 1,000 merges, special tokens <s> </s> <pad> (ids 0, 1, 2);
- tokenizer B: byte-level BPE with 1,500 merges, special tokens <|pad|> <|bos|> <|eos|> (ids 0, 1, 2: other
  strings and other ids for the same roles, so the transplant must match specials by role);
- tokenizer B carries a chat template (the output must have it);
- `base`: a llama (hidden 64, 2 layers, untied output head) trained with A;
- `donor`: a llama (hidden 48, 2 layers, tied embeddings) trained with B (a different width on purpose:
  OMP's coefficients live in the donor's space and are applied to the base's rows, so widths may differ).
Both are saved in bfloat16 (a few hundred KB each) with their tokenizers. Training is plain next-token
cross-entropy with AdamW on one CPU thread, `--minutes` each (the machine is shared): the committed
fixture was made with `--minutes 4` (424 and 630 steps, see its training.json); `--steps 424 630` repeats
that many steps. The donor's chat template was set on the saved donor tokenizer right after (the run
predates `DONOR_CHAT_TEMPLATE` in this script); the script now sets it itself.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import corpus
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = {"a": ("<s>", "</s>", "<pad>"), "b": ("<|pad|>", "<|bos|>", "<|eos|>")}
MERGES = {"a": 1000, "b": 1500}
# the donor's chat template: the transplanted model must come out with it
DONOR_CHAT_TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"


def build_tokenizer(kind: str, text: str) -> PreTrainedTokenizerFast:
    specials = SPECIALS[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(specials) + MERGES[kind],
        special_tokens=list(specials),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    chunks = [text[i : i + 10_000] for i in range(0, len(text), 10_000)]
    tok.train_from_iterator(chunks, trainer)
    if kind == "a":
        bos, eos, pad = specials
    else:
        pad, bos, eos = specials
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    if kind == "b":
        out.chat_template = DONOR_CHAT_TEMPLATE
    return out


def model_config(tokenizer: PreTrainedTokenizerFast, hidden: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def train(
    model: LlamaForCausalLM, ids: torch.Tensor, seconds: float, steps: int | None = None, seq: int = 64, batch: int = 32
) -> int:
    """Train for `seconds` of wall time, or exactly `steps` steps when given (reproducible on one machine)."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    step, started = 0, time.monotonic()
    while (step < steps) if steps is not None else (time.monotonic() - started < seconds):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 200 == 0:
            print(f"  step {step}: loss {loss.item():.3f}", flush=True)
    return step


def perplexity(model: LlamaForCausalLM, ids: torch.Tensor, seq: int = 128) -> float:
    """Mean next-token perplexity over consecutive windows of `seq` tokens."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, seq):
            x = ids[s : s + seq].unsqueeze(0)
            if x.shape[1] < 2:
                break
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
            total += loss.item()
            count += x.shape[1] - 1
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=3.0, help="training time per model")
    parser.add_argument(
        "--steps", type=int, nargs=2, default=None, metavar=("BASE", "DONOR"),
        help="train exactly this many steps instead (the committed fixture: 424 630, its training.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    text = corpus.train_text()
    heldout = corpus.heldout_text()
    report = {}
    for index, (name, kind, hidden, tied) in enumerate((("base", "a", 64, False), ("donor", "b", 48, True))):
        tokenizer = build_tokenizer(kind, text)
        ids = token_stream(tokenizer, text)
        model = LlamaForCausalLM(model_config(tokenizer, hidden, tied))
        print(f"{name}: vocab {len(tokenizer)}, {ids.numel()} training tokens", flush=True)
        steps = train(model, ids, args.minutes * 60, args.steps[index] if args.steps else None)
        ppl = perplexity(model, token_stream(tokenizer, heldout))
        print(f"{name}: {steps} steps, held-out perplexity {ppl:.3f}", flush=True)
        report[name] = {"vocab": len(tokenizer), "steps": steps, "heldout_ppl_fp32": ppl}
        out = args.out / name
        model.to(torch.bfloat16).save_pretrained(out)
        tokenizer.save_pretrained(out)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
