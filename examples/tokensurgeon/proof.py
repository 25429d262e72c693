"""The tokensurgeon proof: transplant the donor's tokenizer onto the base with every method, report
held-out perplexity with the donor tokenizer beside the base's with its own, and compare with
mergekit-tokensurgeon 0.1.5 on the same pair and k.

    PYTHONPATH=src:examples/tokensurgeon python examples/tokensurgeon/proof.py tests/fixtures/tokensurgeon \
        /tmp/proof [--k 32] [--mergekit ~/.cache/mergesmith/mergekit-venv/bin/mergekit-tokensurgeon]

Prints a markdown table (the README's numbers). Perplexity is next-token perplexity over windows of
128 tokens of `corpus.heldout_text()` (text the models never saw), in float32.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import time
from pathlib import Path

import corpus
import torch

METHODS = ("omp", "common_interpolation", "subword", "mean", "zero", "randn")


def perplexity(model_dir: Path, text: str, seq: int = 128) -> tuple[float, float]:
    """(per-token perplexity, bits per character) of `text`: per-token perplexities of two tokenizers are
    not comparable (a longer token carries more text), bits per character are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, seq):
            x = ids[s : s + seq].unsqueeze(0)
            if x.shape[1] < 2:
                break
            logits = model(input_ids=x).logits.float()
            if not torch.isfinite(logits).all():
                raise RuntimeError(f"{model_dir}: non-finite logits")
            total += torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
            count += x.shape[1] - 1
    nats = total / count
    return (math.exp(nats) if nats < 700 else math.inf), total / math.log(2) / len(text)


def transplant(base: Path, donor: Path, out: Path, method: str, k: int) -> float:
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import RunControls
    from mergesmith.tokensurgeon import SurgeryOptions, run_tokensurgeon

    started = time.monotonic()
    run_tokensurgeon(
        base,
        donor,
        out,
        SurgeryOptions(approximation_method=method, k=k),
        MergeOptions(threads=1, random_seed=0, write_model_card=False),
        controls=RunControls(overwrite=True),
    )
    return time.monotonic() - started


def run_mergekit(exe: str, base: Path, donor: Path, out: Path, method: str, k: int) -> float:
    started = time.monotonic()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [exe, str(base), str(donor), str(out), "--approximation-method", method, "--k", str(k)],
        capture_output=True,
        env=env,
        text=True,
    )
    if done.returncode:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(lines[-1] if lines else f"exit {done.returncode}")
    return time.monotonic() - started


def shared_rows(base: Path, out: Path) -> torch.Tensor:
    """Output rows of the tokens the base's and the donor's tokenizers share (by string, specials by role)."""
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(str(base))
    out_tok = AutoTokenizer.from_pretrained(str(out))
    base_vocab, out_vocab = base_tok.get_vocab(), out_tok.get_vocab()
    rows = [out_vocab[t] for t in base_vocab if t in out_vocab]
    for role in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(base_tok, role) is not None and getattr(out_tok, role) is not None:
            rows.append(getattr(out_tok, role))
    return torch.tensor(sorted(set(rows)))



def compare_rows(base: Path, ours: Path, theirs: Path) -> dict[str, float]:
    """Shared rows bit-equal? Approximated rows: max |diff| and mean cosine similarity, per tensor."""
    from safetensors.torch import load_file

    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    out: dict[str, float] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name not in a:
            continue
        x, y = a[name].float(), b[name].float()
        assert x.shape == y.shape, (name, x.shape, y.shape)
        same = (a[name] == b[name]).all(dim=1)
        out[f"{name}:shared_equal"] = bool(same[shared_rows(base, ours)].all())
        # rows that differ anywhere are the approximated ones (copied rows are base bytes in both)
        diff = ~same
        cos = torch.nn.functional.cosine_similarity(x[diff], y[diff], dim=1) if diff.any() else torch.ones(1)
        out[f"{name}:equal_rows"] = int(same.sum())
        out[f"{name}:max_abs_diff"] = float((x - y).abs().max())
        out[f"{name}:min_cos"] = float(cos.min())
        out[f"{name}:mean_cos"] = float(cos.mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fixture", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--mergekit", default=os.path.expanduser("~/.cache/mergesmith/mergekit-venv/bin/mergekit-tokensurgeon")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    base, donor = args.fixture / "base", args.fixture / "donor"
    text = corpus.heldout_text()
    for name, where in (("base", base), ("donor", donor)):
        own, bpc = perplexity(where, text)
        print(f"{name} with its own tokenizer: perplexity {own:.3f}, {bpc:.4f} bits per character")
    print()
    print(
        f"| method (k={args.k}) | mergesmith ppl (bits/char) | mergekit ppl (bits/char) | mergesmith s "
        "| mergekit s | rows equal | approx. rows: min / mean cosine, max abs diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        ours = args.work / f"ms-{method}"
        secs = transplant(base, donor, ours, method, args.k)
        ppl_value, bpc = perplexity(ours, text)
        ppl = f"{ppl_value:.3f} ({bpc:.4f})"
        mk_ppl = mk_secs = "-"
        rows = ""
        if args.mergekit and os.path.exists(args.mergekit):
            theirs = args.work / f"mk-{method}"
            try:
                mk_secs = f"{run_mergekit(args.mergekit, base, donor, theirs, method, args.k):.1f}"
            except RuntimeError as exc:
                print(f"| {method} | {ppl} | fails: {exc} | {secs:.1f} | | | |", flush=True)
                continue
            mk_ppl = "{:.3f} ({:.4f})".format(*perplexity(theirs, text))
            c = compare_rows(base, ours, theirs)
            rows = "; ".join(
                f"{n.split('.')[-2]} {int(c[n + ':equal_rows'])}"
                + ("" if c[n + ":shared_equal"] else " (SHARED ROWS DIFFER)")
                for n in ("model.embed_tokens.weight", "lm_head.weight")
                if n + ":equal_rows" in c
            )
            detail = "; ".join(
                f"{n.split('.')[-2]} {c[n + ':min_cos']:.4f} / {c[n + ':mean_cos']:.4f}, {c[n + ':max_abs_diff']:.2g}"
                for n in ("model.embed_tokens.weight", "lm_head.weight")
                if n + ":min_cos" in c
            )
        else:
            detail = ""
        print(f"| {method} | {ppl} | {mk_ppl} | {secs:.1f} | {mk_secs} | {rows} | {detail} |", flush=True)


if __name__ == "__main__":
    main()
