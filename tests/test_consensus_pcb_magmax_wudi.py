"""consensus_ta, consensus_ties, magmax, pcb and wudi against their papers' equations, written out here.

Each reference below is an independent float64 transcription of the paper's equations (loops and sorts where
the methods vectorise, autograd and torch.optim.Adam where WUDI's method uses its closed-form gradient), run
on realistic shapes: 3 to 4 task vectors of 64x48 and 48x64 matrices and 1-D norms, fine-tune sized (1e-2)
around a unit-scale base. Tolerances are stated per test; bf16 inputs are compared after rounding the float64
reference to bf16, where one bf16 step (2^-8 relative) is the most two correct roundings can differ by.
Then: an old mergekit consensus config runs unchanged through the CLI and loads in transformers, and bad
values are refused at plan time in one line.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml

from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs
from tests.helpers import assert_one_line_error, finite_logits, load_causal_lm, read_state_dict, run_cli

F64 = torch.float64
MATRIX = "model.layers.0.mlp.up_proj.weight"


def run(method: str, tensors: list[torch.Tensor], model_params: list[dict], name: str = MATRIX, **params: Any):
    """The registered method on base (index 0) + fine-tunes, defaults filled in as the planner fills them."""
    spec = get_method(method)
    assert spec is not None
    full = {p.name: p.default for p in spec.params} | params
    per_model = [{}] + [{p.name: p.default for p in spec.model_params} | mp for mp in model_params]
    per_model[0] = {p.name: p.default for p in spec.model_params if not p.non_base}
    return spec.merge(MergeInputs(tensors, 0, per_model, full, None, name))


def models(shape: tuple[int, ...], n: int, seed: int, scale: float = 0.01) -> list[torch.Tensor]:
    """float64 base (unit scale) and n fine-tunes (task vectors of `scale`), the third correlated with the first."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=F64)
    tvs = [scale * torch.randn(shape, generator=g, dtype=F64) for _ in range(n)]
    if n >= 3:
        tvs[2] = 0.6 * tvs[0] + 0.4 * tvs[2]  # some agreement, so signs and masks are not independent coins
    return [base] + [base + t for t in tvs]


def as_dtype(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(dtype) for t in tensors]


def assert_close_bf16(out: torch.Tensor, ref64: torch.Tensor, boundary: float = 0.0) -> None:
    """Within one bf16 step of the float64 reference rounded to bf16 (both round correctly from float32/64).

    `boundary`: the fraction of entries allowed to differ more, for the methods that keep a top fraction (TIES'
    trim, PCB's scores): bf16 task vectors lie on a coarse grid, so magnitudes (and PCB's scores) tie exactly
    at the cut, and which of the tied entries is kept is the sort's choice, not the paper's."""
    assert out.dtype == torch.bfloat16
    ref = ref64.to(torch.bfloat16).to(F64)
    gap = (out.to(F64) - ref).abs()
    step = ref.abs().clamp(min=1e-30) * 2.0**-7
    off = (gap > step).to(F64).mean().item()
    assert off <= boundary, f"{off:.2%} of entries off by more than a bf16 step (max gap {gap.max().item()})"


SHAPES = [(64, 48), (48, 64), (64,)]

# ----- consensus_ta / consensus_ties -------------------------------------------------------------------------------


def ref_trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim: keep the max(1, floor(density n)) largest |tau| (a threshold on the sorted magnitudes)."""
    if density >= 1:
        return tau.clone()
    k = max(1, int(density * tau.numel()))
    threshold = tau.abs().flatten().sort(descending=True).values[k - 1]
    return torch.where(tau.abs() >= threshold, tau, torch.zeros_like(tau))


def ref_consensus(tensors: list[torch.Tensor], weights, lambdas, k: int, ties: bool, density=1.0, normalize=None):
    """Wang et al. 2024: tau_MTL (TA sum or TIES merge), TALL masks |tau_t| > lambda_t |tau_MTL - tau_t|, keep where
    at least k masks agree; mergekit's weights and normalisation around it."""
    base, *fts = [t.to(F64) for t in tensors]
    taus = [x - base for x in fts]
    normalize = ties if normalize is None else normalize
    if ties:
        trimmed = [w * ref_trim(t, density) for t, w in zip(taus, weights)]
        elected = torch.sign(sum(trimmed))
        elected[elected == 0] = 1  # a zero vote elects +
        agree = [(torch.sign(t) == elected).to(F64) for t in trimmed]
        mtl = sum(t * a for t, a in zip(trimmed, agree))
        if normalize:
            divisor = sum(w * a for w, a in zip(weights, agree))
            mtl = mtl / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    else:
        mtl = sum(w * t for w, t in zip(weights, taus))
        if normalize:
            mtl = mtl / sum(weights)
    votes = sum((t.abs() > lam * (mtl - t).abs()).to(torch.int64) for t, lam in zip(taus, lambdas))
    return base + mtl * (votes >= k)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_consensus_ta_equals_the_papers_masks(shape, k):
    """float32 compute from float64 inputs and float64 compute, against the float64 reference (2e-6 and 1e-12:
    the float32 one is a rounding of each input and of the sum; no mask flips on these seeds)."""
    tensors = models(shape, 4, seed=k)
    weights, lambdas = [1.0, 0.83, 1.17, 0.55], [0.41, 0.63, 0.97, 0.52]  # no exact ties on bf16 grids
    mp = [{"weight": w, "lambda": lam, "k": k} for w, lam in zip(weights, lambdas)]
    ref = ref_consensus(tensors, weights, lambdas, k, ties=False)
    out64 = run("consensus_ta", tensors, mp)
    assert out64.dtype == F64 and torch.allclose(out64, ref, rtol=0, atol=1e-12)
    out32 = run("consensus_ta", as_dtype(tensors, torch.float32), mp)
    assert out32.dtype == torch.float32 and torch.allclose(out32.to(F64), ref, rtol=0, atol=2e-6)
    kept = (ref != tensors[0]).to(F64).mean().item()
    assert 0.05 < kept < 1.0 or k == 1, f"k={k}: the consensus mask kept {kept}, the test would not discriminate"
    assert_close_bf16(run("consensus_ta", as_dtype(tensors, torch.bfloat16), mp), ref_consensus(
        as_dtype(as_dtype(tensors, torch.bfloat16), F64), weights, lambdas, k, ties=False))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [1.0, 0.4])
def test_consensus_ties_equals_the_papers_masks_over_ties(shape, density):
    tensors = models(shape, 3, seed=5)
    weights, lambdas = [1.0, 0.71, 0.93], [0.47, 0.53, 0.81]
    mp = [{"weight": w, "lambda": lam, "k": 2, "density": density} for w, lam in zip(weights, lambdas)]
    ref = ref_consensus(tensors, weights, lambdas, 2, ties=True, density=density)
    assert torch.allclose(run("consensus_ties", tensors, mp), ref, rtol=0, atol=1e-12)
    out32 = run("consensus_ties", as_dtype(tensors, torch.float32), mp)
    assert torch.allclose(out32.to(F64), ref, rtol=0, atol=2e-6)
    if density < 1:
        return  # bf16 task vectors of 1e-2 take a handful of values: the trim's cut splits a class of equal ones
    assert_close_bf16(run("consensus_ties", as_dtype(tensors, torch.bfloat16), mp), ref_consensus(
        as_dtype(as_dtype(tensors, torch.bfloat16), F64), weights, lambdas, 2, ties=True, density=density))


def test_consensus_masks_drop_what_only_one_task_claims():
    """A hand-made case at lambda 0.5: entry 0 both tasks move alike (two masks: kept at k=2), entry 1 only the
    first moves (one mask: dropped at k=2, kept at k=1), entry 2 they cancel (0 whatever the masks). At lambda 1
    the strict > of mergekit and the authors' code keeps neither of two equal task vectors: 1 > |2 - 1| fails."""
    base = torch.zeros(3, dtype=F64)
    a = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    b = torch.tensor([1.0, 0.0, -1.0], dtype=F64)
    one = [{"weight": 1.0, "lambda": 1.0, "k": 1}] * 2
    assert run("consensus_ta", [base, a, b], one).tolist() == [0.0, 1.0, 0.0]
    mp = [{"weight": 1.0, "lambda": 0.5}] * 2
    assert run("consensus_ta", [base, a, b], [m | {"k": 2} for m in mp]).tolist() == [2.0, 0.0, 0.0]
    assert run("consensus_ta", [base, a, b], [m | {"k": 1} for m in mp]).tolist() == [2.0, 1.0, 0.0]


# ----- magmax ----------------------------------------------------------------------------------------------------


def ref_magmax(tensors: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Marczak et al. 2024: per entry the task vector of largest |tau| (the later one on a tie), scaled."""
    base, *fts = [t.to(F64) for t in tensors]
    taus = [x - base for x in fts]
    flat = [t.flatten() for t in taus]
    chosen = torch.empty_like(flat[0])
    for j in range(chosen.numel()):
        best = 0
        for t in range(1, len(flat)):
            if abs(flat[t][j]) >= abs(flat[best][j]):
                best = t
        chosen[j] = flat[best][j]
    return base + scale * chosen.view(base.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_magmax_equals_the_papers_selection(shape):
    tensors = models(shape, 4, seed=11)
    ref = ref_magmax(tensors, 0.5)
    assert torch.allclose(run("magmax", tensors, [{}] * 4), ref, rtol=0, atol=1e-12)
    assert torch.allclose(run("magmax", as_dtype(tensors, torch.float32), [{}] * 4).to(F64), ref, rtol=0, atol=2e-6)
    assert torch.allclose(run("magmax", tensors, [{}] * 4, scaling_factor=1.3), ref_magmax(tensors, 1.3), atol=1e-12)
    bf = as_dtype(tensors, torch.bfloat16)
    assert_close_bf16(run("magmax", bf, [{}] * 4), ref_magmax(as_dtype(bf, F64), 0.5))


def test_magmax_ties_go_to_the_later_task_vector():
    base = torch.zeros(2, dtype=F64)
    a, b = torch.tensor([0.5, -0.5], dtype=F64), torch.tensor([-0.5, 0.25], dtype=F64)
    assert run("magmax", [base, a, b], [{}, {}], scaling_factor=1.0).tolist() == [-0.5, -0.5]


# ----- pcb -------------------------------------------------------------------------------------------------------


def ref_pcb(tensors: list[torch.Tensor], ratio: float, weights: list[float]) -> torch.Tensor:
    """Du et al. 2024, eqs. of section 3: b_i = Softmax(N Norm(tau_i tau_i)) * sum_j Softmax(Norm(tau_i tau_j)),
    keep each task's top floor(ratio D) scores, tau_m = sum_i w_i b^_i tau_i / sum_i b^_i (Norm min-max,
    Softmax over the tensor's D entries)."""
    base, *fts = [t.to(F64) for t in tensors]
    taus = [(x - base).flatten() for x in fts]
    n, d = len(taus), taus[0].numel()

    def norm(x):
        return (x - x.min()) / (x.max() - x.min())

    def softmax(x):
        e = torch.exp(x - x.max())
        return e / e.sum()

    kept = []
    for i in range(n):
        score = softmax(n * norm(taus[i] * taus[i])) * sum(softmax(norm(taus[i] * taus[j])) for j in range(n))
        keep = max(1, int(ratio * d))
        threshold = score.sort(descending=True).values[keep - 1]
        kept.append(torch.where(score >= threshold, score, torch.zeros_like(score)))
    total = sum(kept)
    merged = sum(w * b * t for w, b, t in zip(weights, kept, taus)) / torch.where(total > 0, total, 1)
    return base + merged.view(base.shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_pcb_equals_the_papers_balancing(shape, ratio):
    """float64 to 1e-12; float32 to 2e-6 (the scores' softmax and products round, the kept sets agree here)."""
    tensors = models(shape, 4, seed=21)
    weights = [1.0, 1.2, 0.9, 1.0]
    mp = [{"weight": w} for w in weights]
    ref = ref_pcb(tensors, ratio, weights)
    assert torch.allclose(run("pcb", tensors, mp, pcb_ratio=ratio), ref, rtol=0, atol=1e-12)
    out32 = run("pcb", as_dtype(tensors, torch.float32), mp, pcb_ratio=ratio)
    assert out32.dtype == torch.float32 and torch.allclose(out32.to(F64), ref, rtol=0, atol=2e-6)
    bf = as_dtype(tensors, torch.bfloat16)
    assert_close_bf16(run("pcb", bf, mp, pcb_ratio=ratio), ref_pcb(as_dtype(bf, F64), ratio, weights), boundary=0.01)
    dropped = (ref == tensors[0]).to(F64).mean().item()  # entries no task kept
    assert dropped > 0.2 if ratio == 0.1 else dropped > 0.0


def test_pcb_keeps_the_top_fraction_of_scores_per_task():
    """pcb_ratio is the fraction kept: at 1 nothing is dropped and the merge is the score-weighted mean."""
    tensors = models((64, 48), 3, seed=4)
    out = run("pcb", tensors, [{}] * 3, pcb_ratio=1.0)
    assert torch.allclose(out, ref_pcb(tensors, 1.0, [1.0] * 3), atol=1e-12)
    assert bool((out != tensors[0]).all())


# ----- wudi ------------------------------------------------------------------------------------------------------


def wudi_loss(merged: torch.Tensor, taus: list[torch.Tensor]) -> torch.Tensor:
    """Cheng et al. 2025: sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2."""
    return sum(((merged - t) @ t.T).square().sum() / t.square().sum() for t in taus)


def ref_wudi(tensors: list[torch.Tensor], iters: int, lr: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The paper's loop: tau_m from the sum of task vectors, torch.optim.Adam on wudi_loss by autograd, float64."""
    base, *fts = [t.to(F64) for t in tensors]
    taus = [x - base for x in fts]
    merged = torch.nn.Parameter(sum(taus).clone())
    opt = torch.optim.Adam([merged], lr=lr)
    for _ in range(iters):
        opt.zero_grad()
        wudi_loss(merged, taus).backward()
        opt.step()
    return base + merged.detach(), taus


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (8, 96)])
def test_wudi_equals_an_adam_loop_on_the_papers_loss(shape):
    """Both product forms (A where in <= 2 T out, its factors for the wide (8, 96)) give the autograd loop's result:
    float64 to 1e-12, float32 to 1e-6 (about 1% of the 1e-4 the 300 steps move each entry), and the loss
    falls from the sum's to the reference's."""
    tensors = models(shape, 4, seed=31)
    ref, taus = ref_wudi(tensors, 300, 1e-5)
    out64 = run("wudi", tensors, [{}] * 4)
    assert torch.allclose(out64, ref, rtol=0, atol=1e-12)
    out32 = run("wudi", as_dtype(tensors, torch.float32), [{}] * 4)
    assert out32.dtype == torch.float32
    assert torch.allclose(out32.to(F64), ref, rtol=0, atol=1e-6)
    start = wudi_loss(sum(taus), taus).item()
    reached = wudi_loss(out32.to(F64) - tensors[0], taus).item()
    assert reached < 0.9 * start
    assert reached == pytest.approx(wudi_loss(ref - tensors[0], taus).item(), rel=1e-3)
    moved = (ref - tensors[0] - sum(taus)).abs().max().item()
    assert moved > 1e-3, "the steps moved the merged vector too little for the comparison to mean anything"
    bf = as_dtype(tensors, torch.bfloat16)
    assert_close_bf16(run("wudi", bf, [{}] * 4), ref_wudi(as_dtype(bf, F64), 300, 1e-5)[0])


def test_wudi_iterations_and_learning_rate_are_the_parameters():
    tensors = models((48, 32), 3, seed=2)
    ref, _ = ref_wudi(tensors, 40, 3e-4)
    assert torch.allclose(run("wudi", tensors, [{}] * 3, iter_num=40, lr=3e-4), ref, rtol=0, atol=1e-12)
    summed = tensors[0] + sum(t - tensors[0] for t in tensors[1:])
    assert torch.equal(run("wudi", tensors, [{}] * 3, iter_num=0), summed)


@pytest.mark.parametrize("name,shape", [("model.norm.weight", (64,)), ("model.embed_tokens.weight", (64, 48))])
def test_wudi_takes_the_mean_of_norms_and_vocabulary_tensors(name, shape):
    tensors = models(shape, 3, seed=3)
    mean = tensors[0] + sum(t - tensors[0] for t in tensors[1:]) / 3
    assert torch.allclose(run("wudi", tensors, [{}] * 3, name=name), mean, rtol=0, atol=1e-12)


def test_wudi_ignores_an_all_zero_task_vector_and_is_deterministic():
    tensors = models((40, 24), 3, seed=8)
    with_zero = [*tensors, tensors[0].clone()]
    ref, _ = ref_wudi(tensors, 300, 1e-5)  # the zero task vector's term is 0 / 0: left out
    assert torch.allclose(run("wudi", with_zero, [{}] * 4), ref, rtol=0, atol=1e-12)
    f32 = as_dtype(tensors, torch.float32)
    assert torch.equal(run("wudi", f32, [{}] * 3), run("wudi", f32, [{}] * 3))


def test_plan_prices_wudi_by_its_steps():
    """`plan`'s compute estimate counts WUDI's Adam steps: a TinyLlama-sized MLP matrix at 300 steps is minutes of
    CPU, against the fraction of a second the per-entry rate of the other methods gives."""
    from mergesmith.engine.plan import InputRef, TensorRecipe
    from mergesmith.engine.time_estimate import seconds_per_input_entry, wudi_seconds

    inputs = tuple(InputRef(m, "w") for m in ("base", "a", "b", "c"))
    up = TensorRecipe(MATRIX, (5632, 2048), "BF16", "merge", inputs, "wudi", 0, (), (("iter_num", 300),))
    per_entry = 5632 * 2048 * 4 * seconds_per_input_entry("wudi")
    assert wudi_seconds(up) > 100 * per_entry and wudi_seconds(up) > 60
    tenth = TensorRecipe(MATRIX, (5632, 2048), "BF16", "merge", inputs, "wudi", 0, (), (("iter_num", 30),))
    assert wudi_seconds(tenth) == pytest.approx(wudi_seconds(up) / 10)
    assert wudi_seconds(TensorRecipe("model.norm.weight", (2048,), "BF16", "merge", inputs, "wudi", 0)) == 0


# ----- identical models, spec flags -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["consensus_ta", "consensus_ties", "magmax", "pcb", "wudi"])
def test_identical_models_give_the_base_and_the_flags_are_honest(method):
    base = models((16, 8), 1, seed=1)[0].to(torch.float32)
    mp = [{"weight": 1.0}] * 3 if method.startswith("consensus") else [{}] * 3
    out = run(method, [base.clone() for _ in range(4)], mp)
    assert torch.equal(out, base)
    spec = get_method(method)
    assert spec.task_vector and spec.requires_base
    assert spec.elementwise == (method in ("consensus_ta", "magmax"))


# ----- configs: mergekit's old consensus configs, plan-time refusals ----------------------------------------------


@pytest.fixture(scope="module")
def family(tiny_models):
    base = tiny_models("qwen2", seed=11)
    return base, [tiny_models.derive(base, seed=s, scale=0.02) for s in (1, 2, 3)]


MERGEKIT_CONSENSUS = """\
models:
  - model: {a}
    parameters:
      weight: 1.0
      k: 2
      lambda: 0.6
  - model: {b}
    parameters:
      weight: 1.0
      k: 2
      lambda: 0.6
  - model: {c}
    parameters:
      weight: 0.5
      k: 2
      lambda: 0.4
merge_method: {method}
base_model: {base}
parameters:
  normalize: {normalize}
  int8_mask: true
dtype: float32
"""


@pytest.mark.parametrize("method", ["consensus_ta", "consensus_ties"])
def test_an_old_mergekit_consensus_config_runs_through_the_cli_and_loads(tmp_path, capsys, family, method):
    """The YAML as mergekit (#441) users wrote it: per-model k and lambda, int8_mask, normalize."""
    base, (a, b, c) = family
    normalize = "true" if method == "consensus_ties" else "false"
    text = MERGEKIT_CONSENSUS.format(a=a, b=b, c=c, base=base, method=method, normalize=normalize)
    if method == "consensus_ties":
        text = text.replace("      k: 2\n", "      k: 2\n      density: 0.5\n")
    cfg = tmp_path / "c.yml"
    cfg.write_text(text)
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q")
    assert code == 0, err
    finite_logits(load_causal_lm(tmp_path / "out"))
    merged = read_state_dict(tmp_path / "out")
    inputs = [read_state_dict(p) for p in (base, a, b, c)]
    name = "model.layers.0.mlp.up_proj.weight"
    ref = ref_consensus(
        [s[name] for s in inputs], [1.0, 1.0, 0.5], [0.6, 0.6, 0.4], 2, method == "consensus_ties",
        density=0.5, normalize=method == "consensus_ties",
    )
    assert torch.allclose(merged[name].to(F64), ref, rtol=0, atol=1e-6)
    assert not torch.equal(merged[name], inputs[0][name])


@pytest.mark.parametrize(
    "method,where,key,value",
    [
        ("pcb", "global", "pcb_ratio", 0),
        ("pcb", "global", "pcb_ratio", 1.5),
        ("wudi", "global", "iter_num", -1),
        ("wudi", "global", "iter_num", 2.5),
        ("wudi", "global", "lr", 0),
        ("consensus_ta", "model", "k", -1),
        ("consensus_ties", "model", "lambda", -0.5),
    ],
)
def test_bad_values_are_refused_at_plan_time_in_one_line(tmp_path, capsys, family, method, where, key, value):
    base, (a, b, _c) = family
    params = {"weight": 1.0} if method.startswith("consensus") else {}
    config: dict[str, Any] = {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": str(m), "parameters": dict(params)} for m in (a, b)],
    }
    if where == "global":
        config["parameters"] = {key: value}
    else:
        config["models"][0]["parameters"][key] = value
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump(config))
    code, _out, err = run_cli(capsys, "plan", cfg)
    assert_one_line_error(code, err, key, method)
