"""`mergesmith tokensurgeon`: the math (batched OMP), the transplant end to end on the committed fixture
(tests/fixtures/tokensurgeon: two tiny llamas trained on one synthetic corpus with BPEs of 1,000 and
1,500 merges, built by examples/tokensurgeon/make_fixture.py), and the one-line refusals.

The short proof: on held-out text, the model with the donor's tokenizer by OMP must be clearly better
than `mean` and `zero`, and shared rows must be the base's bytes.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mergesmith.tokensurgeon.approximate import batch_omp, common_interpolation
from tests.helpers import assert_one_line_error, finite_logits, load_causal_lm, read_state_dict, run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "tokensurgeon"
BASE, DONOR = FIXTURE / "base", FIXTURE / "donor"
EXAMPLES = Path(__file__).parent.parent / "examples" / "tokensurgeon"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


# ----- the math --------------------------------------------------------------------------------
def _reference_omp(y: torch.Tensor, atoms: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    """OMP for one target, the textbook way: greedy pick by |<r, a>|, refit by lstsq, in float64."""
    chosen: list[int] = []
    r = y.clone()
    coef = torch.zeros(0, dtype=torch.float64)
    for _ in range(k):
        corr = (atoms @ r).abs()
        corr[chosen] = -1
        chosen.append(int(corr.argmax()))
        sub = atoms[chosen]
        coef = torch.linalg.lstsq(sub.T, y.unsqueeze(1)).solution.squeeze(1)
        r = y - coef @ sub
    return chosen, coef


def test_batch_omp_matches_textbook_omp() -> None:
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(300, 40, generator=g, dtype=torch.float64)
    targets = torch.randn(25, 40, generator=g, dtype=torch.float64)
    idx, coef = batch_omp(targets, atoms, 12)
    for b in range(targets.shape[0]):
        chosen, want = _reference_omp(targets[b], atoms, 12)
        assert idx[b].tolist() == chosen
        torch.testing.assert_close(coef[b], want, rtol=1e-8, atol=1e-10)


def test_batch_omp_blocks_and_k_beyond_hidden() -> None:
    g = torch.Generator().manual_seed(1)
    atoms = torch.randn(200, 16, generator=g)
    targets = torch.randn(30, 16, generator=g)
    whole = batch_omp(targets, atoms, 8)
    blocked = batch_omp(targets, atoms, 8, block=7)
    assert torch.equal(whole[0], blocked[0])
    torch.testing.assert_close(whole[1], blocked[1], rtol=1e-4, atol=1e-5)
    # k > hidden: after 16 atoms the fit is exact; the extra atoms must not blow the coefficients up
    idx, coef = batch_omp(targets, atoms, 24)
    fit = torch.bmm(coef.unsqueeze(1), atoms[idx]).squeeze(1)
    assert (fit - targets).norm(dim=1).max() < 1e-3
    assert coef.abs().max() < 100
    with pytest.raises(ValueError, match="k=201"):
        batch_omp(targets, atoms, 201)


def test_common_interpolation_neighbours_and_weights() -> None:
    g = torch.Generator().manual_seed(2)
    atoms = torch.randn(100, 8, generator=g)
    targets = atoms[:5] + 1e-3
    idx, w = common_interpolation(targets, atoms, 4)
    assert idx[:, 0].tolist() == [0, 1, 2, 3, 4]  # the nearest is the atom it was made from
    torch.testing.assert_close(w.sum(dim=1), torch.ones(5))
    assert (w[:, 0] > 0.9).all()
    idx, w = common_interpolation(targets, atoms, 4, scheme="barycentric")
    torch.testing.assert_close(w.sum(dim=1), torch.ones(5), rtol=1e-4, atol=1e-4)


def test_common_interpolation_dependent_neighbours() -> None:
    """Neighbour sets with repeated rows (an embedding table with duplicated tokens) make the least-squares
    systems rank-deficient: the weights are still the best fit (as an SVD solve finds it), and barycentric's
    still sum to 1. torch's default CPU solver (gelsy) got both wrong here: fits 8x worse, sums 0.69 to 1.49."""
    g = torch.Generator().manual_seed(3)
    distinct = torch.randn(60, 16, generator=g)
    atoms = torch.cat([distinct, distinct[:20]])  # rows 60..79 repeat rows 0..19
    targets = distinct[:20] + 0.05 * torch.randn(20, 16, generator=g)
    idx, w = common_interpolation(targets, atoms, 8, scheme="least_squares")
    points = atoms[idx].double()
    fit = torch.bmm(w.double().unsqueeze(1), points).squeeze(1)
    best = torch.linalg.pinv(points.transpose(1, 2)) @ targets.double().unsqueeze(-1)
    best_fit = torch.bmm(best.transpose(1, 2), points).squeeze(1)
    residual, optimum = (fit - targets).norm(dim=1), (best_fit - targets).norm(dim=1)
    assert (residual <= optimum + 1e-4).all(), (residual - optimum).max()
    _, w = common_interpolation(targets, atoms, 8, scheme="barycentric")
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.sum(dim=1), torch.ones(20), rtol=1e-4, atol=1e-4)


def test_common_interpolation_blocks_by_memory() -> None:
    """Without --batch-size, common interpolation takes as many targets at once as fit a quarter of
    --max-memory, as OMP does (it took all of them: per target a row of distances to every shared token, too
    much for a GPU on a real vocabulary); --batch-size still decides when given."""
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.tokensurgeon import SurgeryOptions
    from mergesmith.tokensurgeon.api import build_tokensurgeon_plan
    from mergesmith.tokensurgeon.approximate import interpolation_block_bytes
    from mergesmith.tokensurgeon.table import lookup

    def block(surgery: SurgeryOptions, max_memory: int | None = None) -> tuple[int, int]:
        """(targets per block, bytes per target) of the embedding's recipe."""
        plan, _, _ = build_tokensurgeon_plan(BASE, DONOR, surgery, MergeOptions(threads=1, max_memory=max_memory))
        params = dict(next(r for r in plan.recipes if r.name == EMBED).params)
        shared = lookup(str(params["table"])).shared_base.numel()
        return params["block"], interpolation_block_bytes(shared, 48, surgery.k)

    surgery = SurgeryOptions(approximation_method="common_interpolation", k=8)
    whole, per = block(surgery)
    assert whole == 500  # the 1 GiB default holds every target of this small transplant
    targets, per = block(surgery, max_memory=4 * 100 * per)
    assert targets == 100
    assert block(SurgeryOptions(approximation_method="common_interpolation", k=8, batch_size=7))[0] == 7


# ----- end to end --------------------------------------------------------------------------------
def _heldout() -> str:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import corpus
    finally:
        sys.path.remove(str(EXAMPLES))
    return corpus.Language().text(60, corpus.HELDOUT_SEED)


def _perplexity(model_dir: Path, text: str) -> float:
    from transformers import AutoTokenizer

    model = load_causal_lm(model_dir, dtype=torch.float32)
    ids = torch.tensor(AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"])
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, 128):
            x = ids[s : s + 128].unsqueeze(0)
            if x.shape[1] < 2:
                break
            logits = model(input_ids=x).logits
            assert torch.isfinite(logits).all()
            total += torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
            count += x.shape[1] - 1
    return math.exp(total / count)


@pytest.fixture(scope="module")
def transplanted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.tokensurgeon import SurgeryOptions, run_tokensurgeon

    root = tmp_path_factory.mktemp("surgery")
    out = {}
    for method in ("omp", "mean", "zero"):
        out[method] = root / method
        run_tokensurgeon(
            BASE, DONOR, out[method], SurgeryOptions(approximation_method=method, k=32), MergeOptions(threads=1)
        )
    return out


def test_transplant_keeps_shared_rows_and_takes_the_donor_tokenizer(transplanted: dict[str, Path]) -> None:
    out = transplanted["omp"]
    base_sd, out_sd = read_state_dict(BASE), read_state_dict(out)
    donor_cfg = json.loads((DONOR / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == donor_cfg["vocab_size"] == out_sd[EMBED].shape[0] == out_sd[HEAD].shape[0]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == donor_cfg[key]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == donor_cfg["bos_token_id"] and gen["eos_token_id"] == donor_cfg["eos_token_id"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (DONOR / name).read_bytes()
    # every other tensor is the base's, byte for byte
    for name, tensor in base_sd.items():
        if name not in (EMBED, HEAD):
            assert torch.equal(out_sd[name], tensor), name
    # shared tokens keep the base's rows exactly: same token string -> same bytes (specials by role)
    base_vocab = json.loads((BASE / "tokenizer.json").read_text())["model"]["vocab"]
    donor_vocab = json.loads((DONOR / "tokenizer.json").read_text())["model"]["vocab"]
    pairs = [(donor_vocab[t], i) for t, i in base_vocab.items() if t in donor_vocab]
    pairs += [(1, 0), (2, 1), (0, 2)]  # bos, eos, pad: <|bos|> <|eos|> <|pad|> vs <s> </s> <pad>
    assert len(pairs) > 1200
    d, b = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    for name in (EMBED, HEAD):
        assert out_sd[name].dtype == base_sd[name].dtype
        assert torch.equal(out_sd[name][d], base_sd[name][b]), name
    new = torch.ones(out_sd[EMBED].shape[0], dtype=torch.bool)
    new[d] = False
    assert int(new.sum()) == 500 and out_sd[EMBED][new].abs().sum() > 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert "<|bos|>user: hi<|eos|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    finite_logits(load_causal_lm(out), (1, 5, 600, 1700, 2))


def test_omp_is_clearly_better_than_mean_and_zero(transplanted: dict[str, Path]) -> None:
    text = _heldout()
    ppl = {m: _perplexity(p, text) for m, p in transplanted.items()}
    own = _perplexity(BASE, text)
    assert own < ppl["omp"]  # sanity: the transplant costs something (500 of 1759 tokens are approximated)
    assert ppl["omp"] < 0.75 * ppl["mean"], ppl
    assert ppl["omp"] < 0.75 * ppl["zero"], ppl


def test_tied_base_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The other way round: the tied donor model as BASE (only its embedding is rebuilt, from the untied
    model's embedding), then a rerun that finds the output complete."""
    out = tmp_path / "tied"
    code, stdout, err = run_cli(capsys, "tokensurgeon", DONOR, BASE, out, "--k", "16", "-q")
    assert code == 0, err
    assert "vocabulary 1259" in stdout
    sd = read_state_dict(out)
    assert HEAD not in sd and sd[EMBED].shape == (1259, 48)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 1259 and cfg["bos_token_id"] == 0
    finite_logits(load_causal_lm(out), (0, 5, 600, 1))
    code, stdout, err = run_cli(capsys, "tokensurgeon", DONOR, BASE, out, "--k", "16", "-q")
    assert code == 0 and "already complete" in stdout


# ----- refusals ----------------------------------------------------------------------------------
def _copy(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    return dst


def test_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_tok = _copy(BASE, tmp_path / "notok", drop=("tokenizer.json", "tokenizer_config.json"))
    code, _, err = run_cli(capsys, "tokensurgeon", no_tok, DONOR, tmp_path / "o1")
    assert_one_line_error(code, err, "BASE", "tokenizer")
    code, _, err = run_cli(capsys, "tokensurgeon", BASE, no_tok, tmp_path / "o2")
    assert_one_line_error(code, err, "DONOR", "tokenizer")
    code, _, err = run_cli(capsys, "tokensurgeon", BASE, DONOR, tmp_path / "o3", "--k", "5000")
    assert_one_line_error(code, err, "--k", "5000", "1259")
    # a donor whose vocabulary shares nothing with the base's
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alien = _copy(DONOR, tmp_path / "alien", drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    word = Tokenizer(models.WordLevel({f"[w{i}]": i for i in range(40)}, unk_token="[w0]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word).save_pretrained(alien)
    code, _, err = run_cli(capsys, "tokensurgeon", BASE, alien, tmp_path / "o4")
    assert_one_line_error(code, err, "share no token")
    # omp reads the donor's embeddings: a donor without one is refused; `mean` does not need it
    from safetensors.torch import save_file

    bare = _copy(DONOR, tmp_path / "bare", drop=("model.safetensors",))
    save_file({"model.norm.weight": torch.ones(48)}, str(bare / "model.safetensors"))
    code, _, err = run_cli(capsys, "tokensurgeon", BASE, bare, tmp_path / "o5")
    assert_one_line_error(code, err, "DONOR", "embedding", "omp")
    code, _, err = run_cli(capsys, "tokensurgeon", BASE, bare, tmp_path / "o6", "-a", "mean", "-q")
    assert code == 0, err
    for name in ("o1", "o2", "o3", "o4", "o5"):
        assert not (tmp_path / name / "config.json").exists()


# ----- inside a merge config ---------------------------------------------------------------------
def test_merge_config_transplant(transplanted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """BASE (tokenizer A) merged with a model that speaks tokenizer B (the base transplanted onto B) in one
    step: `tokenizer_source: transplant:<that model>`. The output speaks B; tokens both know keep their rows
    (a linear merge of a row with itself), the others come from OMP over the donor's embeddings."""
    other = transplanted["omp"]
    config = tmp_path / "merge.yml"
    config.write_text(
        "merge_method: linear\n"
        f"base_model: {BASE}\n"
        "models:\n"
        f"  - model: {BASE}\n    parameters: {{weight: 0.5}}\n"
        f"  - model: {other}\n    parameters: {{weight: 0.5}}\n"
        f"tokenizer_source: transplant:{other}\n"
    )
    code, stdout, err = run_cli(capsys, "plan", config, "--tensors")
    assert code == 0, err
    assert f"tokenizer: transplant:{other} (the donor's 1759 tokens" in stdout and "500 approximated" in stdout
    assert "model.embed_tokens.weight [1759, 64] BF16 transplant_merge" in stdout
    assert "transplant_k=[32, 32]" in stdout  # 64, lowered to half the donor's width
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", config, out, "-q")
    assert code == 0, err
    sd, other_sd = read_state_dict(out), read_state_dict(other)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 1759 and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert (out / "tokenizer.json").read_bytes() == (DONOR / "tokenizer.json").read_bytes()
    base_vocab = json.loads((BASE / "tokenizer.json").read_text())["model"]["vocab"]
    donor_vocab = json.loads((DONOR / "tokenizer.json").read_text())["model"]["vocab"]
    d = torch.tensor([donor_vocab[t] for t in base_vocab if t in donor_vocab])
    for name in (EMBED, HEAD):
        assert torch.equal(sd[name][d], other_sd[name][d]), name
    finite_logits(load_causal_lm(out), (1, 5, 600, 1700, 2))
    # the donor must be one of the merged models
    config.write_text(config.read_text().replace(f"transplant:{other}", f"transplant:{DONOR}"))
    capsys.readouterr()
    code, _, err = run_cli(capsys, "plan", config)
    assert_one_line_error(code, err, "tokenizer_source", "not one of the config's models")


def test_row_assignment_exact_byte_prefix() -> None:
    """Exact matches first, then (when allowed) byte tokens and the longest prefix; shared tokens (the OMP
    atoms) are the exact matches only, in donor id order; specials match by role."""
    from mergesmith.tokensurgeon.vocab import Vocabulary, assign_rows, normalize

    def vocab(tokens: list[str], roles: dict[str, str]) -> Vocabulary:
        by = {normalize(t, roles, "Ġ"): i for i, t in enumerate(tokens)}
        return Vocabulary(by, len(tokens), None, {})

    base = vocab(["<s>", "<0x41>", "Ġhel", "lo", "Ġworld"], {"<s>": "bos_token"})
    donor = vocab(["<|bos|>", "Ġworld", "A", "Ġhello", "zz"], {"<|bos|>": "bos_token"})
    plain = assign_rows(base, donor, 5, 5, byte_match=False, prefix_match=False)
    assert plain.source.tolist() == [0, 4, -1, -1, -1]
    assert plain.target_rows.tolist() == [2, 3, 4]
    assert plain.shared_donor.tolist() == [0, 1] and plain.shared_base.tolist() == [0, 4]
    both = assign_rows(base, donor, 5, 5, byte_match=True, prefix_match=True)
    assert both.source.tolist() == [0, 4, 1, 2, -1]  # A -> <0x41>, Ġhello -> Ġhel
    assert both.counts == {"exact": 2, "byte": 1, "prefix": 1, "approximated": 1, "zero": 0}
    assert both.shared_donor.tolist() == [0, 1]
    # rows past a tensor's end do not exist: a base row past it is no match, a donor row past it stays zero
    cut = assign_rows(base, donor, 4, 4, byte_match=False, prefix_match=False)
    assert cut.source.tolist() == [0, -1, -1, -1, -1] and cut.counts["zero"] == 1
