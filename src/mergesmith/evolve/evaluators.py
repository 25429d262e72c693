"""Built-in evaluators: score a loaded causal LM on a local file, with no network and no harness.

- `exact_match`: JSONL of {"prompt", "answer"}; greedy generation from the prompt, the text up to the
  first newline (or end of sequence) compared with the answer, both stripped. Metrics: `acc`
  (= `exact_match`).
- `multiple_choice`: JSONL of {"prompt", "choices": [...], "answer": index or choice text}; the choice
  whose continuation has the highest log-likelihood wins. Metrics: `acc`, `acc_norm` (log-likelihood
  per character of the choice, as lm-eval's acc_norm).
- `loglikelihood`: a text file (one document per non-empty line) or JSONL of {"text"}. Metrics:
  `loglikelihood` (mean per predicted token, higher is better) and `perplexity` (exp of minus that,
  lower is better: give it a negative weight, as in mergekit-evolve).

Written here rather than through lm-evaluation-harness because these must work with nothing but
torch and transformers installed; greedy decoding is transformers' own `generate`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .config import TaskDefinition

METRICS: dict[str, tuple[str, ...]] = {
    "exact_match": ("acc", "exact_match"),
    "multiple_choice": ("acc", "acc_norm"),
    "loglikelihood": ("loglikelihood", "perplexity"),
}
PRIMARY = {"exact_match": "acc", "multiple_choice": "acc", "loglikelihood": "loglikelihood"}
LOWER_IS_BETTER = ("perplexity",)


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in task with its records read and checked (so a bad file fails before the first merge)."""

    name: str
    kind: str
    metric: str
    weight: float
    records: tuple[Any, ...]
    max_new_tokens: int

    def metric_of(self, scores: dict[str, float]) -> float:
        return scores[self.metric]


def _metric_name(metric: str | None, kind: str) -> str:
    if metric is None:
        return PRIMARY[kind]
    return metric.split(",")[0].strip()  # lm-eval writes `acc,none`: metric, filter


def _read_records(task: TaskDefinition, source: str) -> list[Any]:
    path = Path(task.data or "")
    where = f"{source}: task {task.name!r}: {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: data file not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    if task.type == "loglikelihood" and path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{where}:{n}: not a JSON object") from None
        need = {"exact_match": ("prompt", "answer"), "multiple_choice": ("prompt", "choices", "answer"),
                "loglikelihood": ("text",)}[task.type or ""]
        missing = [k for k in need if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise ConfigError(f"{where}:{n}: missing key `{missing[0]}`")
        if task.type == "multiple_choice":
            choices, answer = rec["choices"], rec["answer"]
            if not isinstance(choices, list) or len(choices) < 2:
                raise ConfigError(f"{where}:{n}: `choices` must be a list of at least two strings")
            if isinstance(answer, str):
                if answer not in choices:
                    raise ConfigError(f"{where}:{n}: `answer` {answer!r} is not one of the choices")
                rec = {**rec, "answer": choices.index(answer)}
            elif not isinstance(answer, int) or not 0 <= answer < len(choices):
                raise ConfigError(f"{where}:{n}: `answer` must be a choice or its index")
        records.append(rec if task.type != "loglikelihood" else rec["text"])
    if not records:
        raise ConfigError(f"{where}: no records")
    return records


def resolve_builtin(task: TaskDefinition, limit: int | None, source: str) -> BuiltinTask:
    """Check a built-in task's metric and data file; one ConfigError line naming what is wrong."""
    kind = task.type or ""
    metric = _metric_name(task.metric, kind)
    if metric not in METRICS[kind]:
        raise ConfigError(
            f"{source}: task {task.name!r}: metric {task.metric!r} is not reported by a `{kind}` task "
            f"(it reports {', '.join(METRICS[kind])})"
        )
    records = _read_records(task, source)
    if limit is not None:
        records = records[:limit]
    return BuiltinTask(task.name, kind, metric, task.weight, tuple(records), task.max_new_tokens or 0)


# -- scoring -----------------------------------------------------------------------------------------------


def score_builtin(task: BuiltinTask, model: Any, tokenizer: Any, batch_size: int = 32) -> dict[str, float]:
    """Every metric of `task` for `model` (in eval mode, on its device), deterministic for fixed weights."""
    import torch

    with torch.inference_mode():
        if task.kind == "exact_match":
            return _exact_match(task, model, tokenizer, batch_size)
        if task.kind == "multiple_choice":
            return _multiple_choice(task, model, tokenizer, batch_size)
        return _loglikelihood(task, model, tokenizer, batch_size)


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _pad_id(tokenizer: Any) -> int:
    for tok in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tok is not None:
            return int(tok)
    return 0


def _exact_match(task: BuiltinTask, model: Any, tokenizer: Any, batch_size: int) -> dict[str, float]:
    import torch

    device = next(model.parameters()).device
    pad = _pad_id(tokenizer)
    correct = 0
    for i in range(0, len(task.records), batch_size):
        batch = task.records[i : i + batch_size]
        prompts = [_encode(tokenizer, r["prompt"], True) for r in batch]
        answers = [str(r["answer"]).strip() for r in batch]
        new_tokens = task.max_new_tokens or max(len(_encode(tokenizer, a, False)) for a in answers) + 2
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row, answer in enumerate(answers):
            text = tokenizer.decode(out[row, width:].tolist(), skip_special_tokens=True)
            correct += int(text.split("\n")[0].strip() == answer)
    acc = correct / len(task.records)
    return {"acc": acc, "exact_match": acc}


def _sequence_logprobs(model: Any, seqs: list[tuple[list[int], int]], pad: int) -> list[tuple[float, int]]:
    """For each (tokens, n_context): the summed log-probability of tokens[n_context:] and their count."""
    import torch

    device = next(model.parameters()).device
    width = max(len(t) for t, _ in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, (toks, _) in enumerate(seqs):
        ids[row, : len(toks)] = torch.tensor(toks)
        mask[row, : len(toks)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = ids[:, 1:].to(device)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu()
    out = []
    for row, (toks, n_ctx) in enumerate(seqs):
        start = max(n_ctx, 1) - 1
        span = picked[row, start : len(toks) - 1]
        out.append((float(span.sum()), int(span.numel())))
    return out


def _multiple_choice(task: BuiltinTask, model: Any, tokenizer: Any, batch_size: int) -> dict[str, float]:
    pad = _pad_id(tokenizer)
    seqs: list[tuple[list[int], int]] = []
    owners: list[tuple[int, int, int]] = []  # (record, choice, characters)
    for r_i, rec in enumerate(task.records):
        ctx = _encode(tokenizer, rec["prompt"], True)
        for c_i, choice in enumerate(rec["choices"]):
            seqs.append((ctx + _encode(tokenizer, str(choice), False), len(ctx)))
            owners.append((r_i, c_i, max(len(str(choice)), 1)))
    scores: list[float] = []
    for i in range(0, len(seqs), batch_size):
        scores += [lp for lp, _ in _sequence_logprobs(model, seqs[i : i + batch_size], pad)]
    best: dict[int, tuple[float, int]] = {}
    best_norm: dict[int, tuple[float, int]] = {}
    for (r_i, c_i, chars), lp in zip(owners, scores):
        if r_i not in best or lp > best[r_i][0]:
            best[r_i] = (lp, c_i)
        if r_i not in best_norm or lp / chars > best_norm[r_i][0]:
            best_norm[r_i] = (lp / chars, c_i)
    n = len(task.records)
    acc = sum(best[i][1] == rec["answer"] for i, rec in enumerate(task.records)) / n
    acc_norm = sum(best_norm[i][1] == rec["answer"] for i, rec in enumerate(task.records)) / n
    return {"acc": acc, "acc_norm": acc_norm}


def _loglikelihood(task: BuiltinTask, model: Any, tokenizer: Any, batch_size: int) -> dict[str, float]:
    pad = _pad_id(tokenizer)
    seqs = [(_encode(tokenizer, text, True), 1) for text in task.records]
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        for lp, n in _sequence_logprobs(model, seqs[i : i + batch_size], pad):
            total += lp
            count += n
    mean = total / max(count, 1)
    return {"loglikelihood": mean, "perplexity": math.exp(-mean)}
