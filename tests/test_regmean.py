"""regmean (Jin et al., ICLR 2023): the merge math against float64 numpy, the Gram collection against forward hooks
on the whole transformers model, an end-to-end merge, the plan-time refusals, and resuming an interrupted
collection.

tests/fixtures/regmean/calibration.txt: 24 lines of 4 to 14 random words `tok4`..`tok255` (the tiny models'
vocabulary, tests/model_factory.py), drawn with random.Random(32).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import build_plan, run_merge
from mergesmith.io.journal import STATE_PARTS
from mergesmith.methods import MergeInputs, require_method
from tests.helpers import assert_one_line_error, finite_logits, load_causal_lm, read_state_dict, run_cli, write_config

CALIBRATION = Path(__file__).parent / "fixtures" / "regmean" / "calibration.txt"
RATIO = 0.6


# ----- the merge math -------------------------------------------------------------------------------------------
def _reference_regmean(weights: list[np.ndarray], grams: list[np.ndarray], alpha: float) -> np.ndarray:
    """The paper's closed form in float64: W*^T = (sum G_i')^-1 sum G_i' W_i^T, G' = alpha G + (1 - alpha) diag G."""
    reduced = [alpha * g + (1 - alpha) * np.diag(np.diag(g)) for g in grams]
    lhs = sum(reduced)
    rhs = sum(g @ w.T for g, w in zip(reduced, weights))
    return np.linalg.solve(lhs, rhs).T


def _grams(rng: np.random.Generator, n: int, size: int) -> list[np.ndarray]:
    """Gram matrices of realistic inputs: correlated features of unequal scale, averaged over the tokens."""
    out = []
    for _ in range(n):
        mix = rng.normal(size=(size, size)) * 0.3 + np.eye(size)
        x = rng.normal(size=(300, size)) @ mix * rng.uniform(0.2, 3.0, size=size)
        out.append(x.T @ x / x.shape[0])
    return out


def _merge(tensors: list[torch.Tensor], grams: bool, ratio: float = RATIO) -> torch.Tensor:
    spec = require_method("regmean")
    params = {"reduce_non_diagonal_ratio": ratio, "regmean_grams": grams}
    return spec.merge(MergeInputs(tensors, None, [{} for _ in tensors], params, tensor_name="t"))


@pytest.mark.parametrize("ratio", [RATIO, 1.0])
def test_linear_weights_equal_the_float64_closed_form(ratio):
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(48, 64)) * 0.05 for _ in range(3)]
    grams = _grams(rng, 3, 64)
    expected = _reference_regmean(weights, grams, ratio)
    got = _merge([torch.tensor(w, dtype=torch.float32) for w in weights + grams], True, ratio)
    assert got.dtype == torch.float32 and got.shape == (48, 64)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=2e-4, atol=2e-6)
    # float64 inputs stay float64: the same answer to float64 precision
    got64 = _merge([torch.tensor(a) for a in weights + grams], True, ratio)
    np.testing.assert_allclose(got64.numpy(), expected, rtol=1e-10, atol=1e-13)
    # and not merely the average: the Grams matter
    assert np.abs(expected - np.mean(weights, axis=0)).max() > 1e-3


def test_identical_weights_give_that_weight_whatever_the_grams():
    rng = np.random.default_rng(4)
    weight = rng.normal(size=(20, 16))
    grams = _grams(rng, 3, 16)
    tensors = [torch.tensor(a, dtype=torch.float32) for a in [weight] * 3 + grams]
    got = _merge(tensors, True)
    np.testing.assert_allclose(got.double().numpy(), weight, rtol=1e-4, atol=1e-5)


def test_ratio_zero_weights_each_input_feature_by_its_energy():
    """alpha = 0 leaves only the diagonals: each column is the average of the models' columns weighted by G_kk."""
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=(40, 24)) for _ in range(4)]
    grams = _grams(rng, 4, 24)
    diag = np.stack([np.diag(g) for g in grams])  # models x in
    expected = sum(d[None, :] * w for d, w in zip(diag, weights)) / diag.sum(axis=0)[None, :]
    got = _merge([torch.tensor(w, dtype=torch.float32) for w in weights + grams], True, 0.0)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_other_tensors_are_the_simple_average_in_their_dtype():
    rng = np.random.default_rng(2)
    norms = [rng.normal(size=64) for _ in range(3)]
    got = _merge([torch.tensor(x, dtype=torch.bfloat16) for x in norms], False)
    assert got.dtype == torch.bfloat16
    rounded = [torch.tensor(x, dtype=torch.bfloat16).double().numpy() for x in norms]
    np.testing.assert_allclose(got.double().numpy(), np.mean(rounded, axis=0), rtol=8e-3, atol=1e-3)


def test_a_singular_sum_falls_back_to_least_squares():
    """An input feature no model saw (zero row and column in every Gram): its column is zero, the rest solved."""
    rng = np.random.default_rng(3)
    weights = [rng.normal(size=(8, 6)) for _ in range(2)]
    grams = _grams(rng, 2, 6)
    for g in grams:
        g[2, :] = 0.0
        g[:, 2] = 0.0
    got = _merge([torch.tensor(a) for a in weights + grams], True).numpy()
    keep = [0, 1, 3, 4, 5]
    expected = _reference_regmean([w[:, keep] for w in weights], [g[np.ix_(keep, keep)] for g in grams], RATIO)
    np.testing.assert_allclose(got[:, keep], expected, rtol=1e-9, atol=1e-12)
    assert np.abs(got[:, 2]).max() < 1e-12


# ----- the Gram collection ----------------------------------------------------------------------------------------
def _hooked_grams(model_dir: Path, lines: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Independent of the feature: the whole model in float32, a forward hook on every nn.Linear, one line at a time,
    X^T X summed in float64 and divided by the token count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def fn(_m, args, _out):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        return fn

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(hook(name))
    with torch.no_grad():
        for line in lines:
            ids = tok(line, truncation=True, max_length=max_length)["input_ids"]
            model(input_ids=torch.tensor([ids]))
    return {name: (total / counts[name]).float() for name, total in sums.items()}


def _calibration_lines(n: int) -> list[str]:
    return [line for line in CALIBRATION.read_text().splitlines() if line.strip()][:n]


def _config(models: list[Path], **parameters: Any) -> dict[str, Any]:
    params = {"calibration": str(CALIBRATION), "num_regmean_examples": 10, "max_length": 12, **parameters}
    return {"merge_method": "regmean", "models": [{"model": str(m)} for m in models], "parameters": params}


@pytest.mark.parametrize(
    "arch, overrides, mode",
    [
        ("llama", {}, "layers"),
        ("qwen3", {"tie_word_embeddings": True}, "layers"),
        ("mistral", {"sliding_window": 4}, "layers"),  # lines of up to 12 tokens: the window matters
        ("phi3", {}, "whole"),  # not streamed: loaded whole by transformers
    ],
)
def test_collected_grams_equal_hooks_on_the_whole_model(tmp_path, tiny_models, arch, overrides, mode):
    from mergesmith.regmean.collect import collect_grams

    model = tiny_models(arch, seed=5, **overrides)
    tied = bool(overrides.get("tie_word_embeddings"))
    plan, _ = build_plan(write_config(tmp_path / "c.yml", _config([model, model])), MergeOptions())
    options = plan.options["regmean"]
    (entry,) = options["models"].values()
    assert entry["mode"] == mode  # the llama family is streamed one decoder layer at a time
    out = tmp_path / "out"
    out.mkdir()
    made = collect_grams(options, out, None)
    (ckpt,) = made.values()
    expected = _hooked_grams(model, _calibration_lines(10), 12)
    linear_weights = {n[: -len(".weight")] for n in read_state_dict(model) if f"{n[: -len('.weight')]}" in expected}
    assert set(ckpt.tensors) == linear_weights == set(entry["modules"])
    # a tied output head is the embedding: averaged with it, no Gram
    assert ("lm_head" in ckpt.tensors) == ("lm_head.weight" in read_state_dict(model)) == (not tied)
    for name in ckpt.tensors:
        torch.testing.assert_close(ckpt.get(name), expected[name], rtol=1e-4, atol=1e-5, msg=name)

    if mode == "whole":
        return
    # the fallback for other architectures (the whole model through transformers) collects the same Grams
    whole = {**options, "models": {"m": {**entry, "mode": "whole"}}}
    (ckpt_whole,) = collect_grams(whole, out, None).values()
    for name in ckpt.tensors:
        torch.testing.assert_close(ckpt_whole.get(name), ckpt.get(name), rtol=1e-4, atol=1e-5, msg=name)


def test_a_stop_between_layers_keeps_the_finished_ones(tmp_path, tiny_models):
    """Ctrl-C (the run's stop event) during the collection: MergeInterrupted after the layer in hand is written."""
    from mergesmith.errors import MergeInterrupted
    from mergesmith.regmean.collect import collect_grams
    from mergesmith.regmean.store import store_dir

    model = tiny_models("llama", seed=5)
    plan, _ = build_plan(write_config(tmp_path / "c.yml", _config([model])), MergeOptions())
    out = tmp_path / "out"
    out.mkdir()
    stop = threading.Event()
    stop.set()
    with pytest.raises(MergeInterrupted, match="run the same command again"):
        collect_grams(plan.options["regmean"], out, stop)
    assert sorted(p.name for p in store_dir(out, str(model)).iterdir()) == ["grams-00000.safetensors"]


# ----- end to end -------------------------------------------------------------------------------------------------
def test_merge_solves_every_linear_weight_from_the_models_grams(tmp_path, tiny_models, capsys):
    base = tiny_models("llama", seed=21)
    a = tiny_models.derive(base, seed=1, scale=0.05)
    b = tiny_models.derive(base, seed=2, scale=0.05)
    config = write_config(tmp_path / "c.yml", _config([a, b]))
    code, out, err = run_cli(capsys, "plan", config)
    assert code == 0, err
    assert "before merging (regmean): collect input Gram matrices of 29 linear weights: 2 models x 10" in out
    tokens = 2 * sum(min(len(line.split()), 12) for line in _calibration_lines(10))  # one token a word, no specials
    weights = read_state_dict(a)
    linear = [n for n, t in weights.items() if t.dim() == 2 and "embed" not in n]  # 4 x 7 projections, lm_head
    flops = 2 * tokens * sum(weights[n].numel() + weights[n].shape[1] ** 2 for n in linear)  # matmuls and X^T X
    assert f"= 20 forward passes over {tokens} tokens (about {flops / 1e6:.3g} MFLOP), one decoder layer" in out
    code, _out, err = run_cli(capsys, "merge", config, tmp_path / "out", "-q")
    assert code == 0, err
    merged = read_state_dict(tmp_path / "out")
    finite_logits(load_causal_lm(tmp_path / "out"))
    assert not (tmp_path / "out").joinpath(*STATE_PARTS, "regmean").exists()  # the Grams go once the merge is done

    lines = _calibration_lines(10)
    grams = [_hooked_grams(m, lines, 12) for m in (a, b)]
    inputs = [read_state_dict(m) for m in (a, b)]
    solved = 0
    for name, tensor in merged.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module in grams[0]:
            ws = [sd[name].double().numpy() for sd in inputs]
            gs = [g[module].double().numpy() for g in grams]
            expected = _reference_regmean(ws, gs, RATIO)
            np.testing.assert_allclose(tensor.double().numpy(), expected, rtol=2e-3, atol=2e-5, err_msg=name)
            solved += 1
        else:
            expected = (inputs[0][name].double() + inputs[1][name].double()) / 2
            torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-7, msg=name)
    assert solved == 29  # 4 layers x 7 projections + lm_head


def test_plan_refuses_a_missing_or_empty_calibration_file_and_a_model_without_tokenizer(tmp_path, tiny_models, capsys):
    model = tiny_models("llama", seed=21)
    missing = write_config(tmp_path / "a.yml", _config([model, model], calibration=str(tmp_path / "none.txt")))
    assert_one_line_error(*run_cli(capsys, "plan", missing)[::2], "parameters.calibration", "none.txt")
    (tmp_path / "blank.txt").write_text("\n  \n")
    blank = write_config(tmp_path / "b.yml", _config([model, model], calibration=str(tmp_path / "blank.txt")))
    assert_one_line_error(*run_cli(capsys, "plan", blank)[::2], "parameters.calibration", "blank.txt")
    unset = _config([model, model])
    del unset["parameters"]["calibration"]
    assert_one_line_error(*run_cli(capsys, "plan", write_config(tmp_path / "c.yml", unset))[::2], "calibration")
    bad_ratio = write_config(tmp_path / "d.yml", _config([model, model], reduce_non_diagonal_ratio=1.5))
    assert_one_line_error(*run_cli(capsys, "plan", bad_ratio)[::2], "reduce_non_diagonal_ratio")
    bare = tiny_models("llama", seed=22, tokenizer=False)
    no_tok = write_config(tmp_path / "e.yml", _config([bare, tiny_models("llama", seed=23, tokenizer=False)]))
    assert_one_line_error(*run_cli(capsys, "plan", no_tok)[::2], str(bare), "tokenizer")


def test_an_interrupted_collection_resumes_without_collecting_finished_layers(tmp_path, tiny_models, monkeypatch):
    import mergesmith.regmean.collect as collect
    from mergesmith.regmean.store import model_key

    base = tiny_models("llama", seed=31)
    a = tiny_models.derive(base, seed=1, scale=0.05)
    b = tiny_models.derive(base, seed=2, scale=0.05)
    config = write_config(tmp_path / "c.yml", _config([a, b]))
    out = tmp_path / "out"
    env = {**os.environ, "MERGESMITH_TEST_KILL_AT": "atomic_done@grams-00001.safetensors"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "mergesmith", "merge", str(config), str(out), "-q"], env=env, capture_output=True
    )
    assert run.returncode == -9, run.stderr.decode()
    assert not (out / "config.json").exists()
    store = out.joinpath(*STATE_PARTS, "regmean")
    (first,) = [d for d in store.iterdir() if (d / "grams-00001.safetensors").exists()]
    kept = {f.name: f.stat().st_mtime_ns for f in first.iterdir() if f.suffix == ".safetensors"}
    assert set(kept) == {"grams-00000.safetensors", "grams-00001.safetensors"}

    written: list[tuple[str, str]] = []
    real = collect.write_grams

    def record(out_dir, model, name, grams, tokens):
        written.append((model, name))
        real(out_dir, model, name, grams, tokens)

    monkeypatch.setattr(collect, "write_grams", record)
    mtimes: dict[str, int] = {}
    real_open = collect.open_checkpoint

    def opened(path):  # the finished files, just before the merge reads them: untouched by the rerun
        if Path(path) == first:
            mtimes.update({n: (first / n).stat().st_mtime_ns for n in kept})
        return real_open(path)

    monkeypatch.setattr(collect, "open_checkpoint", opened)
    run_merge(config, out, MergeOptions())
    assert mtimes == kept
    (first_model,) = [m for m in (str(a), str(b)) if model_key(m) == first.name]
    files = [f"grams-{i:05d}.safetensors" for i in range(4)] + ["grams-head.safetensors"]
    done = {(first_model, name) for name in kept}
    expected = [(m, f) for m in (str(a), str(b)) for f in files if (m, f) not in done]
    assert sorted(written) == sorted(expected)
    fresh = tmp_path / "fresh"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a host that set its own thread count (another test in this worker may have)
    try:
        run_merge(config, fresh, MergeOptions())
    finally:
        torch.set_num_threads(before)
    assert (out / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_a_link_in_the_gram_store_is_never_written_through(tmp_path, tiny_models, capsys):
    model = tiny_models("llama", seed=21)
    out, outside = tmp_path / "out", tmp_path / "outside"
    state = out.joinpath(*STATE_PARTS)
    state.mkdir(parents=True)
    outside.mkdir()
    (state / "regmean").symlink_to(outside)
    config = write_config(tmp_path / "c.yml", _config([model]))
    code, _out, err = run_cli(capsys, "merge", config, out, "-q")
    assert_one_line_error(code, err, "regmean", "link", exit_code=code)
    assert code != 0 and list(outside.iterdir()) == []
