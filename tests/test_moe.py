"""MoE assembly (`mergesmith moe`, mergekit-moe configs): outputs load in transformers as Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3; routers route; router weights follow
mergekit-moe's definitions exactly; randomness is seeded; plans are stable (resume works) and change
with prompts and modes; bad configs fail with one line naming the key or model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mergesmith.cli import main
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import RunControls
from mergesmith.errors import MergeInterrupted
from mergesmith.moe import build_moe_plan, run_moe
from tests.helpers import finite_logits, load_causal_lm, read_state_dict

# Four experts, each with prompts over its own token range, so the base model "sees" them differently.
TOKEN_RANGES = (range(10, 20), range(60, 70), range(110, 120), range(160, 170))
PROMPTS = [[" ".join(f"tok{t}" for t in list(r)[i : i + 3]) for i in range(0, 8, 2)] for r in TOKEN_RANGES]
HIDDEN = 32  # tiny_models' hidden size


@pytest.fixture(autouse=True)
def router_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Router weights go to a per-test cache, never to the user's ~/.cache."""
    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "moe-router"


def write_config(tmp_path: Path, config: dict[str, Any], name: str = "moe.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def experts_config(base: Path, models: list[Path], mode: str, **extra: Any) -> dict[str, Any]:
    experts = [{"source_model": str(m), "positive_prompts": p} for m, p in zip(models, PROMPTS)]
    return {"base_model": str(base), "gate_mode": mode, "experts": experts, **extra}


def token_ids(prompt: str) -> list[int]:
    """BOS then the word-level ids (`tokN` is id N in every tiny tokenizer)."""
    return [1] + [int(word.removeprefix("tok")) for word in prompt.split()]


def routing_shares(model: Any, prompts: list[str]) -> torch.Tensor:
    """The router's mean probability per expert at the last token of `prompts`, over prompts and layers.

    The prompts have equal lengths, so they run as one batch without padding.
    """
    ids = torch.tensor([token_ids(p) for p in prompts])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    batch, seq = ids.shape
    per_layer = [logits.reshape(batch, seq, -1)[:, -1].softmax(-1).mean(0) for logits in out.router_logits]
    return torch.stack(per_layer).mean(0)


def hidden_gate_rows(base: Path, prompts: list[str]) -> torch.Tensor:
    """mergekit-moe's `hidden` gate vector per layer [layers, hidden], computed here independently: the
    residual stream entering each layer at each prompt's last token (each prompt run alone), averaged
    over the prompts, normalised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    rows = []
    for prompt in prompts:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([token_ids(prompt)]), output_hidden_states=True)
        rows.append(torch.stack(out.hidden_states[:-1])[:, 0, -1])
    mean = torch.stack(rows).mean(0)
    return mean / mean.norm(dim=-1, keepdim=True)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return (exc.value.code if isinstance(exc.value.code, int) else 1), captured.out, captured.err


def one_line_error(code: int, err: str, *names: str) -> str:
    lines = err.strip("\n").splitlines()
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


# ----- Mixtral: loading, routing, provenance ----------------------------------------------------


@pytest.mark.parametrize(("arch", "mode"), [("llama", "hidden"), ("mistral", "cheap_embed")])
def test_mixtral_loads_and_routes_each_experts_prompts_to_it(tmp_path, tiny_models, arch, mode):
    models = [tiny_models(arch, seed=s) for s in (1, 2, 3, 4)]
    cfg = write_config(tmp_path, experts_config(models[0], models, mode, experts_per_token=2, dtype="float32"))
    warnings: list[str] = []
    result = run_moe(cfg, tmp_path / "out", MergeOptions(threads=2), on_warning=warnings.append)
    assert warnings == []

    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    base_cfg = json.loads((models[0] / "config.json").read_text())
    assert out_cfg["architectures"] == ["MixtralForCausalLM"] and out_cfg["model_type"] == "mixtral"
    assert out_cfg["num_local_experts"] == 4 and out_cfg["num_experts_per_tok"] == 2
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert out_cfg[key] == base_cfg[key], key
    assert out_cfg["rope_parameters"] == base_cfg["rope_parameters"]

    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == "MixtralForCausalLM"
    finite_logits(model)
    for expert, prompts in enumerate(PROMPTS):
        shares = routing_shares(model, prompts)
        assert int(shares.argmax()) == expert, f"expert {expert}'s prompts route to {shares.tolist()}"

    # Provenance: attention from the base, expert e's projections from model e, unit-norm router rows.
    state = read_state_dict(tmp_path / "out")
    base, donors = read_state_dict(models[0]), [read_state_dict(m) for m in models]
    assert len(state) == len(result.plan.recipes)
    for layer in range(4):
        p = f"model.layers.{layer}."
        assert torch.equal(state[p + "self_attn.q_proj.weight"], base[p + "self_attn.q_proj.weight"])
        for e, donor in enumerate(donors):
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                got = state[f"{p}block_sparse_moe.experts.{e}.{mine}.weight"]
                assert torch.equal(got, donor[f"{p}mlp.{theirs}.weight"]), (layer, e, mine)
        router = state[p + "block_sparse_moe.gate.weight"]
        assert router.shape == (4, HIDDEN)
        torch.testing.assert_close(router.norm(dim=-1), torch.ones(4))
    assert not any(".mlp." in name for name in state)


@pytest.mark.parametrize("mode", ["hidden", "hidden_avg"])
def test_hidden_router_weights_are_the_base_models_residual_states(tmp_path, tiny_models, monkeypatch, mode):
    """mergekit-moe's `hidden`: per layer, the residual stream entering the layer at each prompt's last
    token (`hidden_avg`: averaged over the prompt's tokens), averaged over positive prompts, minus the
    negatives' average, normalised. Prompts of different lengths in batches of 2 (so left padding is
    exercised) must give what each prompt gives alone."""
    from transformers import AutoModelForCausalLM

    import mergesmith.moe.router as router_mod

    monkeypatch.setattr(router_mod, "PROMPT_BATCH", 2)
    base, other = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    positive = [["tok10 tok11 tok12 tok13", "tok14", "tok15 tok16"], ["tok60 tok61", "tok62 tok63 tok64"]]
    negative = [["tok90 tok91 tok92"], []]
    experts = [
        {"source_model": str(m), "positive_prompts": p, **({"negative_prompts": n} if n else {})}
        for m, p, n in zip((base, other), positive, negative)
    ]
    cfg = write_config(tmp_path, {"base_model": str(base), "gate_mode": mode, "experts": experts})
    progress: list[tuple[int, int]] = []
    run_moe(cfg, tmp_path / "out", MergeOptions(), on_gate_progress=lambda d, t: progress.append((d, t)))
    assert progress[-1] == (6, 6)

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()

    def mean_state(prompts: list[str]) -> torch.Tensor:  # [layers, hidden], each prompt run alone
        rows = []
        for prompt in prompts:
            with torch.no_grad():
                out = model(input_ids=torch.tensor([token_ids(prompt)]), output_hidden_states=True)
            states = torch.stack(out.hidden_states[:-1])[:, 0]  # [layers, seq, hidden]
            rows.append(states.mean(1) if mode == "hidden_avg" else states[:, -1])
        return torch.stack(rows).mean(0)

    state = read_state_dict(tmp_path / "out")
    for e in range(2):
        want = mean_state(positive[e]) - (mean_state(negative[e]) if negative[e] else 0)
        want = want / want.norm(dim=-1, keepdim=True)
        for layer in range(4):
            got = state[f"model.layers.{layer}.block_sparse_moe.gate.weight"][e]
            torch.testing.assert_close(got, want[layer], rtol=1e-4, atol=1e-5)


def test_cheap_embed_router_weights_are_normalised_prompt_embeddings(tmp_path, tiny_models):
    base, other = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    experts = [
        {"source_model": str(base), "positive_prompts": ["tok10 tok11", "tok12"], "negative_prompts": ["tok30"]},
        {"source_model": str(other), "positive_prompts": ["tok60 tok61 tok62"]},
    ]
    cfg = write_config(tmp_path, {"base_model": str(base), "gate_mode": "cheap_embed", "experts": experts})
    run_moe(cfg, tmp_path / "out", MergeOptions())
    embed = read_state_dict(base)["model.embed_tokens.weight"]

    def vec(prompts: list[str]) -> torch.Tensor:
        ids = [i for p in prompts for i in token_ids(p)]
        total = embed[ids].sum(0)
        return total / total.norm()

    want = [vec(["tok10 tok11", "tok12"]) - vec(["tok30"]), vec(["tok60 tok61 tok62"])]
    state = read_state_dict(tmp_path / "out")
    for layer in range(4):
        router = state[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        for e in range(2):
            torch.testing.assert_close(router[e], want[e] / want[e].norm(), rtol=1e-5, atol=1e-6)


def _swap_tokens(root: Path, a: str, b: str) -> None:
    """Exchange two words' ids in a word-level tokenizer.json (a tokenizer unlike the base's)."""
    path = root / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))


def test_hidden_router_of_a_lora_base_is_the_adapted_models(tmp_path, tiny_models):
    """`base_model: B+adapter` routes with the adapted model: its router weights differ from plain B's
    and equal those of a directory holding B with the adapter merged in (by PEFT) and the adapter's
    own tokenizer (which maps the first expert's words elsewhere than B's does)."""
    import shutil

    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base, other = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), lora)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    wrapped.save_pretrained(str(adapter))
    wrapped.merge_and_unload().save_pretrained(str(merged))
    for root in (adapter, merged):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(base / name, root / name)
        _swap_tokens(root, "tok10", "tok200")

    def routers(base_model: str, name: str) -> torch.Tensor:
        config = experts_config(base, [base, other], "hidden")
        config["base_model"] = base_model
        out = tmp_path / "out" / name
        run_moe(write_config(tmp_path, config, f"{name}.yml"), out, MergeOptions())
        state = read_state_dict(out)
        return torch.stack([state[f"model.layers.{i}.block_sparse_moe.gate.weight"] for i in range(4)])

    with_lora = routers(f"{base}+{adapter}", "lora")
    plain = routers(str(base), "plain")
    assert (with_lora - plain).abs().max() > 1e-2
    torch.testing.assert_close(with_lora, routers(str(merged), "merged"), rtol=1e-4, atol=1e-5)


# ----- Qwen2-MoE and Qwen3-MoE ------------------------------------------------------------------


def test_qwen2_moe_with_a_gated_shared_expert(tmp_path, tiny_models):
    models = [tiny_models("qwen2", seed=s) for s in (1, 2)]
    shared_src = tiny_models("qwen2", seed=3)
    config = experts_config(models[0], models, "hidden", experts_per_token=1)
    config["shared_experts"] = [
        {"source_model": str(shared_src), "positive_prompts": ["tok200 tok201"], "residual_scale": 0.5}
    ]
    run_moe(write_config(tmp_path, config), tmp_path / "out", MergeOptions())

    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["architectures"] == ["Qwen2MoeForCausalLM"] and out_cfg["model_type"] == "qwen2_moe"
    assert out_cfg["num_experts"] == 2 and out_cfg["num_experts_per_tok"] == 1
    assert out_cfg["moe_intermediate_size"] == out_cfg["shared_expert_intermediate_size"] == 64
    assert out_cfg["tie_word_embeddings"] is True
    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    finite_logits(model)
    for expert, prompts in enumerate(PROMPTS[:2]):
        ids = torch.tensor([token_ids(prompts[0])])
        with torch.no_grad():
            logits = model(input_ids=ids, output_router_logits=True).router_logits[0]
        assert int(logits.reshape(ids.shape[1], -1)[-1].argmax()) == expert

    state = read_state_dict(tmp_path / "out")
    shared = read_state_dict(shared_src)
    assert "lm_head.weight" not in state  # tied, as in the base
    p = "model.layers.2.mlp."
    torch.testing.assert_close(state[p + "shared_expert.down_proj.weight"], shared[p + "down_proj.weight"] * 0.5)
    assert torch.equal(state[p + "shared_expert.up_proj.weight"], shared[p + "up_proj.weight"])
    assert state[p + "shared_expert_gate.weight"].shape == (1, HIDDEN)
    # the gate row is the base's normalised hidden state on the shared expert's own prompt, and the
    # routed rows are the experts' (not, e.g., the last routed expert's row again)
    shared_want = hidden_gate_rows(models[0], ["tok200 tok201"])
    routed_want = [hidden_gate_rows(models[0], prompts) for prompts in PROMPTS[:2]]
    for layer in range(4):
        p = f"model.layers.{layer}.mlp."
        torch.testing.assert_close(state[p + "shared_expert_gate.weight"][0], shared_want[layer], rtol=1e-4, atol=1e-5)
        for e in range(2):
            torch.testing.assert_close(state[p + "gate.weight"][e], routed_want[e][layer], rtol=1e-4, atol=1e-5)


def test_qwen2_moe_from_llama_gets_zero_qkv_biases(tmp_path, tiny_models):
    models = [tiny_models("llama", seed=s) for s in (1, 2)]
    config = experts_config(models[0], models, "random", architecture="qwen")
    config["shared_experts"] = [{"source_model": str(models[1])}]
    run_moe(write_config(tmp_path, config), tmp_path / "out", MergeOptions(random_seed=1))
    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    finite_logits(model)
    state = read_state_dict(tmp_path / "out")
    assert state["model.layers.0.self_attn.k_proj.bias"].shape == (16,)
    assert not state["model.layers.0.self_attn.q_proj.bias"].any()
    assert state["model.layers.3.mlp.shared_expert_gate.weight"].shape == (1, HIDDEN)


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Tiny Qwen3 checkpoints (the shared factory has no qwen3): q/k norms, explicit head_dim."""
    import transformers
    from transformers import AutoModelForCausalLM

    from tests.model_factory import make_tokenizer, save_model

    paths = []
    root = tmp_path_factory.mktemp("qwen3")
    for seed in (1, 2, 3):
        config = transformers.Qwen3Config(
            vocab_size=256,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = save_model(model, root / f"qwen3-{seed}")
        make_tokenizer(path, 256)
        paths.append(path)
    return paths


def test_qwen3_moe_through_the_cli_with_uniform_random_gates(tmp_path, qwen3_models, capsys):
    config = experts_config(qwen3_models[0], qwen3_models, "uniform_random", experts_per_token=2, dtype="bfloat16")
    path = write_config(tmp_path, config)
    code, out, err = run_cli(capsys, "moe", path, tmp_path / "out", "--random-seed", "7", "-q")
    assert code == 0, err
    assert "Qwen3-MoE, 3 experts, 2 per token" in out and "random seed 7" in out
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["architectures"] == ["Qwen3MoeForCausalLM"] and out_cfg["num_experts"] == 3
    assert out_cfg["num_experts_per_tok"] == 2 and out_cfg["moe_intermediate_size"] == 64
    assert out_cfg["head_dim"] == 8 and out_cfg["dtype"] == "bfloat16"
    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    finite_logits(model)
    state = read_state_dict(tmp_path / "out")
    router = state["model.layers.1.mlp.gate.weight"]
    assert router.dtype == torch.bfloat16 and router.shape == (3, HIDDEN)
    assert float(router.float().abs().max()) <= 1 / math.sqrt(HIDDEN) + 1e-3
    assert "random seed used: 7" in (tmp_path / "out" / "mergekit_moe_config.yml").read_text()


# ----- DeepSeek-V2 and DeepSeek-V3 --------------------------------------------------------------


DEEPSEEK_WIDTHS = {1: 64, 2: 64, 3: 64, 4: 128, 5: 96}
"""Seed -> MLP width of the tiny dense DeepSeek checkpoints: three alike experts, a shared expert two
experts wide, and one whose width is no multiple of theirs."""


def _deepseek_config(model_type: str, width: int, dense: bool = True) -> Any:
    """A tiny DeepSeek config, dense in every layer unless `dense` is False; V3 with a low-rank query
    (q_a_proj/q_b_proj), V2 with a plain q_proj, so both MLA variants are covered."""
    import transformers

    cls = transformers.DeepseekV3Config if model_type == "deepseek_v3" else transformers.DeepseekV2Config
    extra = {"q_lora_rank": 16, "n_group": 1, "topk_group": 1} if model_type == "deepseek_v3" else {"q_lora_rank": None}
    return cls(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=width,
        moe_intermediate_size=width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        first_k_dense_replace=2 if dense else 0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`deepseek_models("deepseek_v3", seed)` -> a tiny dense checkpoint (built once per module), and
    seed 0: an MoE one (not dense), which cannot be an expert."""
    from transformers import AutoModelForCausalLM

    from tests.model_factory import make_tokenizer, save_model

    root = tmp_path_factory.mktemp("deepseek")
    built: dict[tuple[str, int], Path] = {}

    def get(model_type: str, seed: int) -> Path:
        if (model_type, seed) not in built:
            config = _deepseek_config(model_type, DEEPSEEK_WIDTHS.get(seed, 64), dense=seed != 0)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            path = save_model(model, root / f"{model_type}-{seed}")
            make_tokenizer(path, 256)
            built[(model_type, seed)] = path
        return built[(model_type, seed)]

    return get


@pytest.mark.parametrize(("model_type", "mode"), [("deepseek_v2", "hidden"), ("deepseek_v3", "cheap_embed")])
def test_deepseek_moe_from_dense_deepseek_models(tmp_path, deepseek_models, model_type, mode):
    """mergekit's `architecture: deepseek` from dense DeepSeek models: every layer MoE, the experts'
    MLPs as routed experts, an ungated shared expert two experts wide (n_shared_experts 2), the base's
    MLA attention, routers that send each expert's prompts to it (V3: a zero score-correction bias)."""
    models = [deepseek_models(model_type, s) for s in (1, 2, 3)]
    shared_src = deepseek_models(model_type, 4)
    config = experts_config(models[0], models, mode, experts_per_token=2, architecture="deepseek")
    config["shared_experts"] = [{"source_model": str(shared_src), "residual_scale": 0.5}]
    warnings: list[str] = []
    result = run_moe(write_config(tmp_path, config), tmp_path / "out", MergeOptions(), on_warning=warnings.append)
    assert warnings == []

    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    base_cfg = json.loads((models[0] / "config.json").read_text())
    class_name = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[model_type]
    assert out_cfg["architectures"] == [class_name] and out_cfg["model_type"] == model_type
    assert out_cfg["n_routed_experts"] == 3 and out_cfg["num_experts_per_tok"] == 2
    assert out_cfg["moe_intermediate_size"] == 64 and out_cfg["n_shared_experts"] == 2
    assert out_cfg["first_k_dense_replace"] == 0 and out_cfg["moe_layer_freq"] == 1
    assert out_cfg["routed_scaling_factor"] == 1.0
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "hidden_size"):
        assert out_cfg[key] == base_cfg[key], key
    if model_type == "deepseek_v3":
        assert out_cfg["n_group"] == out_cfg["topk_group"] == 1 and out_cfg["norm_topk_prob"] is True
        assert (out_cfg["scoring_func"], out_cfg["topk_method"]) == ("sigmoid", "noaux_tc")
    else:  # transformers' V2 router never renormalises: say so for runtimes that read the key
        assert out_cfg["norm_topk_prob"] is False
        assert (out_cfg["scoring_func"], out_cfg["topk_method"]) == ("softmax", "greedy")

    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == class_name
    finite_logits(model)
    for expert, prompts in enumerate(PROMPTS[:3]):
        shares = routing_shares(model, prompts)
        assert int(shares.argmax()) == expert, f"expert {expert}'s prompts route to {shares.tolist()}"

    state = read_state_dict(tmp_path / "out")
    base, shared = read_state_dict(models[0]), read_state_dict(shared_src)
    donors = [read_state_dict(m) for m in models]

    # The MoE block computes what the module docstring says, from the donors' own MLPs: the top two
    # experts by router score (V3: sigmoid, renormalised; V2: softmax probabilities as they are), plus
    # the shared expert (down projection halved by residual_scale) on every token.
    def mlp(weights: dict[str, torch.Tensor], x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        p = "model.layers.1.mlp."
        hidden = torch.nn.functional.silu(x @ weights[p + "gate_proj.weight"].T) * (x @ weights[p + "up_proj.weight"].T)
        return hidden @ (weights[p + "down_proj.weight"] * scale).T

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    logits = x @ state["model.layers.1.mlp.gate.weight"].T
    scores = logits.sigmoid() if model_type == "deepseek_v3" else logits.softmax(-1)
    top, chosen = scores.topk(2, dim=-1)
    if model_type == "deepseek_v3":
        top = top / top.sum(-1, keepdim=True)
    want = mlp(shared, x, 0.5)
    for token in range(5):
        for weight, e in zip(top[token], chosen[token]):
            want[token] += weight * mlp(donors[int(e)], x[token : token + 1])[0]
    with torch.no_grad():
        got = model.model.layers[1].mlp(x[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(state) == len(result.plan.recipes) and not any(".mlp.gate_proj" in n for n in state)
    attention = ["kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", "o_proj"]
    attention += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if model_type == "deepseek_v3" else ["q_proj"]
    for layer in range(2):
        p = f"model.layers.{layer}."
        for name in attention:
            assert torch.equal(state[f"{p}self_attn.{name}.weight"], base[f"{p}self_attn.{name}.weight"]), name
        for e, donor in enumerate(donors):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                got = state[f"{p}mlp.experts.{e}.{proj}.weight"]
                assert torch.equal(got, donor[f"{p}mlp.{proj}.weight"]), (layer, e, proj)
        want = shared[p + "mlp.down_proj.weight"] * 0.5
        torch.testing.assert_close(state[p + "mlp.shared_experts.down_proj.weight"], want)
        assert torch.equal(state[p + "mlp.shared_experts.gate_proj.weight"], shared[p + "mlp.gate_proj.weight"])
        router = state[p + "mlp.gate.weight"]
        assert router.shape == (3, HIDDEN)
        torch.testing.assert_close(router.norm(dim=-1), torch.ones(3))
        if model_type == "deepseek_v3":
            bias = state[p + "mlp.gate.e_score_correction_bias"]
            assert bias.dtype == torch.float32 and bias.shape == (3,) and not bias.any()


def test_deepseek_moe_without_a_shared_expert_through_the_cli(tmp_path, deepseek_models, capsys):
    """No `shared_experts`: the family's shared module is written empty (n_shared_experts 0), as
    transformers itself saves such a config; chosen by the inputs' type without `architecture`."""
    models = [deepseek_models("deepseek_v2", s) for s in (1, 2)]
    path = write_config(tmp_path, experts_config(models[0], models, "random", experts_per_token=1, dtype="bfloat16"))
    code, out, err = run_cli(capsys, "moe", path, tmp_path / "out", "--random-seed", "3", "-q")
    assert code == 0, err
    assert "DeepSeek-V2, 2 experts, 1 per token" in out
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["n_shared_experts"] == 0 and out_cfg["dtype"] == "bfloat16"
    model = load_causal_lm(tmp_path / "out")
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    finite_logits(model)
    state = read_state_dict(tmp_path / "out")
    assert state["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (0, HIDDEN)
    assert state["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (HIDDEN, 0)
    assert state["model.layers.1.mlp.experts.1.up_proj.weight"].dtype == torch.bfloat16


def test_bad_deepseek_moe_configs_fail_with_one_line(tmp_path, deepseek_models, tiny_models, capsys, router_cache):
    v2, v3 = ([deepseek_models(t, s) for s in (1, 2)] for t in ("deepseek_v2", "deepseek_v3"))
    llama = [tiny_models("llama", seed=s) for s in (1, 2)]
    ungated = experts_config(v3[0], v3, "hidden")
    ungated["shared_experts"] = [{"source_model": str(v3[1]), "positive_prompts": ["tok200"]}]
    uneven = experts_config(v2[0], v2, "random")
    uneven["shared_experts"] = [{"source_model": str(deepseek_models("deepseek_v2", 5))}]
    cases = {
        # a llama-like base cannot fill MLA attention: refused by type, saying why
        "llama": (
            experts_config(llama[0], llama, "hidden", architecture="deepseek"),
            ("`architecture`", "DeepSeek-V2 is built from deepseek_v2", "DeepSeek-V3", "'llama'", "MLA"),
        ),
        "mixed": (experts_config(v2[0], [v2[0], v3[1]], "random"), ("experts[1].source_model", "deepseek_v3")),
        "shared_prompts": (ungated, ("shared_experts[0]", "ungated", "DeepSeek-V3")),
        "uneven_shared": (uneven, ("shared_experts[0].source_model", "96", "multiple", "64")),
        "one_v3_expert": (
            experts_config(v3[0], v3[:1], "random", experts_per_token=1),
            ("`base_model`", "DeepSeek-V3 needs at least 2"),
        ),
        "moe_expert": (
            experts_config(v2[0], [v2[0], deepseek_models("deepseek_v2", 0)], "random"),
            ("experts[1].source_model", "mlp.experts", "DeepSeek-V2"),
        ),
        "qwen_from_deepseek": (
            experts_config(v2[0], v2, "random", architecture="qwen2_moe"),
            ("`architecture`", "Qwen2-MoE is built from", "'deepseek_v2'"),
        ),
    }
    lines = {}
    for name, (config, names) in cases.items():
        path = write_config(tmp_path, config, f"{name}.yml")
        code, _out, err = run_cli(capsys, "moe", path, tmp_path / name)
        lines[name] = one_line_error(code, err, *names)
        assert not (tmp_path / name / "config.json").exists(), name
    assert not router_cache.exists()
    # the reason is said once, and a DeepSeek input's problem is not buried under the families it is no input of
    assert lines["llama"].count("MLA") == 1, lines["llama"]
    for name in ("shared_prompts", "one_v3_expert"):
        assert "Mixtral" not in lines[name] and "DeepSeek-V2" not in lines[name], lines[name]


# ----- repeated experts, seeds, plans, resume ---------------------------------------------------


def test_one_model_as_every_expert_upcycles_with_no_warning_and_no_extra_memory(tmp_path, tiny_models, recwarn, caplog):
    src = tiny_models("llama", seed=1)
    same = {"base_model": str(src), "gate_mode": "random", "experts": [{"source_model": str(src)}] * 4}
    warned: list[str] = []
    result = run_moe(
        write_config(tmp_path, same), tmp_path / "out", MergeOptions(random_seed=3), on_warning=warned.append
    )
    assert warned == [] and not recwarn.list
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    load_causal_lm(tmp_path / "out")
    state, donor = read_state_dict(tmp_path / "out"), read_state_dict(src)
    for e in range(4):
        got = state[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]
        assert torch.equal(got, donor["model.layers.1.mlp.down_proj.weight"])
    # Each input tensor is read once however many experts share it, and the working set is that of
    # four different experts of the same shapes: repetition costs no extra memory.
    distinct = [tiny_models("llama", seed=s) for s in (1, 2, 3, 4)]
    other = {**same, "experts": [{"source_model": str(m)} for m in distinct]}
    plan_distinct, _, _ = build_moe_plan(write_config(tmp_path, other, "d.yml"), MergeOptions(random_seed=3))
    est, est_distinct = result.plan.estimate, plan_distinct.estimate
    assert est is not None and est_distinct is not None
    router_bytes = 4 * 4 * HIDDEN * 4
    assert est.bytes_read == sum(t.numel() * 4 for t in donor.values()) + router_bytes
    assert est.peak_memory == est_distinct.peak_memory


def test_random_gates_and_expert_noise_follow_the_seed(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    config = {
        "base_model": str(a),
        "gate_mode": "random",
        "experts": [{"source_model": str(a)}, {"source_model": str(b), "noise_scale": 0.01}],
    }
    cfg = write_config(tmp_path, config)
    runs = {}
    for name, seed in (("s5", 5), ("s5again", 5), ("s6", 6)):
        run_moe(cfg, tmp_path / name, MergeOptions(random_seed=seed))
        runs[name] = read_state_dict(tmp_path / name)
    router, noisy, clean = (
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.1.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    )
    for name in (router, noisy, clean):
        assert torch.equal(runs["s5"][name], runs["s5again"][name])
    assert not torch.equal(runs["s5"][router], runs["s6"][router])
    assert not torch.equal(runs["s5"][noisy], runs["s6"][noisy])
    assert torch.equal(runs["s5"][clean], runs["s6"][clean])
    delta = runs["s5"][noisy] - read_state_dict(b)["model.layers.0.mlp.gate_proj.weight"]
    assert 0.005 < float(delta.std()) < 0.02
    # Without --random-seed one is drawn, recorded, and reused by a rerun into the same directory.
    drawn = run_moe(cfg, tmp_path / "drawn", MergeOptions())
    assert drawn.plan.random_seed is not None
    assert f"random seed used: {drawn.plan.random_seed}" in (tmp_path / "drawn" / "mergekit_moe_config.yml").read_text()
    assert f"`{drawn.plan.random_seed}`" in (tmp_path / "drawn" / "README.md").read_text()
    again, _, _ = build_moe_plan(cfg, MergeOptions(), tmp_path / "drawn")
    assert again.random_seed == drawn.plan.random_seed


def test_plan_fingerprint_is_stable_and_follows_prompts_and_mode(tmp_path, tiny_models, router_cache, capsys):
    models = [tiny_models("llama", seed=s) for s in (1, 2)]
    config = experts_config(models[0], models, "hidden")
    cfg = write_config(tmp_path, config)
    first, _, gates = build_moe_plan(cfg, MergeOptions())
    assert build_moe_plan(cfg, MergeOptions())[0].fingerprint() == first.fingerprint()
    assert not router_cache.exists()  # planning runs no forward pass
    gates.materialize()
    assert gates.path.is_file()
    gates.path.unlink()  # a cleared cache changes nothing: the plan names the weights by what decides them
    assert build_moe_plan(cfg, MergeOptions())[0].fingerprint() == first.fingerprint()

    changed_prompt = json.loads(json.dumps(config))
    changed_prompt["experts"][1]["positive_prompts"][0] = "tok61 tok60"
    negative = json.loads(json.dumps(config))
    negative["experts"][0]["negative_prompts"] = ["tok99"]
    variants = [changed_prompt, negative, {**config, "gate_mode": "cheap_embed"}, {**config, "gate_mode": "random"}]
    prints = {first.fingerprint()}
    for i, variant in enumerate(variants):
        plan, _, _ = build_moe_plan(write_config(tmp_path, variant, f"v{i}.yml"), MergeOptions(random_seed=1))
        prints.add(plan.fingerprint())
    assert len(prints) == 1 + len(variants)

    code, out, err = run_cli(capsys, "plan", cfg, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["method"] == "moe" and report["moe"]["architecture"] == "Mixtral"
    names = {t["name"] for t in report["tensors"]}
    assert "model.layers.3.block_sparse_moe.gate.weight" in names
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight" in names
    code, out, err = run_cli(capsys, "plan", cfg)
    assert code == 0 and "moe: Mixtral, 2 experts, 2 per token" in out


def test_plan_estimate_counts_the_router_pass(tmp_path, tiny_models, capsys):
    """`hidden` loads the whole base into transformers and `cheap_embed` turns the embedding into
    float32 before assembly: the plan's bytes read and peak memory include that pass, it is named as
    the largest working set when it is, and a --max-memory it exceeds is reported (plan and moe)."""
    from mergesmith.io.checkpoint import Checkpoint

    models = [tiny_models("llama", seed=s, dtype=torch.bfloat16) for s in (1, 2)]
    base = Checkpoint.open(str(models[0]))
    embed = base.info("model.embed_tokens.weight")
    reports = {}
    for mode in ("random", "cheap_embed", "hidden"):
        cfg = write_config(tmp_path, experts_config(models[0], models, mode), f"{mode}.yml")
        code, out, err = run_cli(capsys, "plan", cfg, "--json", "--random-seed", "1")
        assert code == 0, err
        reports[mode] = json.loads(out)
    random, cheap, hidden = reports["random"], reports["cheap_embed"], reports["hidden"]
    assert cheap["bytes_read"] - random["bytes_read"] == embed.nbytes
    assert hidden["bytes_read"] - random["bytes_read"] == base.total_bytes
    # working memory (the read-ahead buffers aside: a merge this small may read all its inputs ahead)
    assert hidden["peak_memory_bytes"] >= base.total_bytes > random["peak_memory_bytes"] - random["read_ahead_bytes"]
    assert hidden["largest_tensor"] == {
        "name": "router pass (gate_mode hidden: the whole base model in transformers)",
        "working_bytes": base.total_bytes,
    }
    assert cheap["peak_memory_bytes"] >= embed.nbytes * 3  # bf16 read plus a float32 copy

    budget = str(base.total_bytes // 2)
    code, out, err = run_cli(capsys, "plan", tmp_path / "hidden.yml", "--json", "--max-memory", budget)
    assert code == 0, err
    over = json.loads(out)["over_budget"]
    assert over is not None and over["tensor"].startswith("router pass") and over["bytes"] == base.total_bytes
    code, out, err = run_cli(capsys, "plan", tmp_path / "random.yml", "--json", "--max-memory", budget)
    assert code == 0 and json.loads(out)["over_budget"] is None, err
    code, out, err = run_cli(capsys, "moe", tmp_path / "hidden.yml", tmp_path / "out", "--max-memory", budget, "-q")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "router pass" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "--max-memory" in lines[0], err


def test_an_interrupted_assembly_resumes_without_recomputing_the_router(tmp_path, tiny_models):
    import threading

    models = [tiny_models("llama", seed=s) for s in (1, 2, 3)]
    cfg = write_config(tmp_path, experts_config(models[0], models, "hidden"))
    options = dict(out_shard_size=60_000, threads=1)
    stop = threading.Event()

    def stop_after_some(event: Any) -> None:
        if event.tensors_done >= 25:
            stop.set()

    with pytest.raises(MergeInterrupted):
        controls = RunControls(on_progress=stop_after_some, stop=stop)
        run_moe(cfg, tmp_path / "out", MergeOptions(**options), controls=controls)
    assert not (tmp_path / "out" / "config.json").exists()
    calls: list[int] = []
    result = run_moe(cfg, tmp_path / "out", MergeOptions(**options), on_gate_progress=lambda d, t: calls.append(d))
    assert calls == []  # the router weights came from the cache
    assert result.shards_reused >= 1 and len(result.plan.shards) > 2
    run_moe(cfg, tmp_path / "fresh", MergeOptions(**options))
    resumed, fresh = read_state_dict(tmp_path / "out"), read_state_dict(tmp_path / "fresh")
    assert resumed.keys() == fresh.keys() and all(torch.equal(resumed[k], fresh[k]) for k in fresh)
    load_causal_lm(tmp_path / "out")


# ----- bad configs: one line, exit 2, naming the key or model ------------------------------------


def _bad_configs(tiny_models: Any) -> dict[str, tuple[dict[str, Any], tuple[str, ...]]]:
    llama = [tiny_models("llama", seed=s) for s in (1, 2)]
    base = experts_config(llama[0], llama, "hidden")

    def with_expert(i: int, **changes: Any) -> dict[str, Any]:
        cfg = json.loads(json.dumps(base))
        cfg["experts"][i].update(changes)
        return {k: v for k, v in cfg.items()}

    no_prompts = json.loads(json.dumps(base))
    del no_prompts["experts"][1]["positive_prompts"]
    same_prompts = json.loads(json.dumps(base))
    same_prompts["experts"][1]["positive_prompts"] = same_prompts["experts"][0]["positive_prompts"]
    misspelt = json.loads(json.dumps(base))
    misspelt["experts"][0]["positive_prompt"] = misspelt["experts"][0].pop("positive_prompts")
    return {
        "other_arch": (
            with_expert(1, source_model=str(tiny_models("qwen2", seed=1))),
            ("experts[1].source_model", "qwen2"),
        ),
        "other_width": (
            with_expert(1, source_model=str(tiny_models("llama", seed=5, hidden_size=64))),
            ("experts[1].source_model", "hidden size", "64"),
        ),
        "too_many_per_token": ({**base, "experts_per_token": 3}, ("experts_per_token", "3", "2 experts")),
        "no_prompts": (no_prompts, ("experts[1].positive_prompts", "hidden")),
        "empty_prompt": (with_expert(0, positive_prompts=["  "]), ("experts[0].positive_prompts[0]", "empty")),
        "same_prompts": (same_prompts, ("experts", "same prompts")),
        "all_same_model": (
            with_expert(1, source_model=str(llama[0])),
            ("experts", "--i-understand-this-is-not-useful-without-training"),
        ),
        "deepseek": ({**base, "architecture": "deepseek"}, ("architecture", "deepseek_v2", "MLA")),
        "unknown_arch": ({**base, "architecture": "switch"}, ("architecture", "unsupported target architecture")),
        "mixtral_shared": (
            {**base, "architecture": "mixtral", "shared_experts": [{"source_model": str(llama[1])}]},
            ("architecture", "shared"),
        ),
        "gemma": (
            experts_config(tiny_models("gemma", seed=1), [tiny_models("gemma", seed=1)] * 2, "random"),
            ("base_model", "unsupported target architecture", "gemma"),
        ),
        "misspelt_key": (misspelt, ("experts[0].positive_prompt", "did you mean `positive_prompts`")),
        "bad_mode": ({**base, "gate_mode": "hiden"}, ("gate_mode",)),
    }


def test_bad_moe_configs_fail_with_one_line_naming_the_key(tmp_path, tiny_models, capsys, router_cache):
    lines = {}
    for name, (config, names) in _bad_configs(tiny_models).items():
        path = write_config(tmp_path, config, f"{name}.yml")
        code, _out, err = run_cli(capsys, "moe", path, tmp_path / name)
        lines[name] = one_line_error(code, err, *names)
        assert not (tmp_path / name / "config.json").exists(), name
    assert not router_cache.exists()
    # a gemma base fits no family by type: say so for each, not that Qwen2-MoE wants a shared expert
    assert "shared_experts" not in lines["gemma"], lines["gemma"]
    for family in ("Mixtral is built from", "Qwen2-MoE is built from", "Qwen3-MoE is built from"):
        assert family in lines["gemma"], lines["gemma"]
    # mergekit-moe's escape hatch for one model as every expert with prompt-based gates; --load-in-4bit (mergekit
    # quantizes the base model for the hidden states) is accepted with one note: the model runs in its own dtype
    flag = "--i-understand-this-is-not-useful-without-training"
    args = ("moe", tmp_path / "all_same_model.yml", tmp_path / "same", flag, "-q", "--load-in-4bit")
    code, _out, err = run_cli(capsys, *args)
    assert code == 0 and (tmp_path / "same" / "config.json").is_file(), err
    notes = [line for line in err.splitlines() if line.startswith("note: `--load-in-4bit`")]
    assert len(notes) == 1 and "own dtype" in notes[0], err


def test_merge_of_an_moe_config_points_to_the_moe_command(tmp_path, tiny_models, capsys):
    models = [tiny_models("llama", seed=s) for s in (1, 2)]
    path = write_config(tmp_path, experts_config(models[0], models, "random"))
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out")
    one_line_error(code, err, "mergesmith moe")


def test_alike_prompts_warn_of_degenerate_routing_every_run(tmp_path, tiny_models, capsys):
    models = [tiny_models("llama", seed=s) for s in (1, 2)]
    config = experts_config(models[0], models, "cheap_embed")
    shared = " ".join(f"tok{t}" for t in range(10, 40))  # 30 tokens in common, one apart
    config["experts"][0]["positive_prompts"] = [shared + " tok50"]
    config["experts"][1]["positive_prompts"] = [shared + " tok51"]
    cfg = write_config(tmp_path, config)
    warned: list[str] = []
    run_moe(cfg, tmp_path / "a", MergeOptions(), on_warning=warned.append)
    assert len(warned) == 1 and "degenerate in every layer" in warned[0]
    code, _out, err = run_cli(capsys, "moe", cfg, tmp_path / "b", "-q")  # router weights from the cache
    assert code == 0 and err.startswith("warning: router weights are nearly degenerate"), err
    distinct = write_config(tmp_path, experts_config(models[0], models, "cheap_embed"), "distinct.yml")
    warned.clear()
    run_moe(distinct, tmp_path / "c", MergeOptions(), on_warning=warned.append)
    assert warned == []
