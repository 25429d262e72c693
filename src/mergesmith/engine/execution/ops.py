"""Recipe operations beyond `copy` and `merge`: how an output tensor is assembled from its inputs.

Planners other than the merge planner (MoE assembly, ...) need to build one output tensor from
several inputs without any merge math, e.g. stacking dense MLP weights into a fused expert tensor.
Each op is a pure function of the recipe and a loader that returns an input tensor; registering it
(extensions.register_op) is all the executor needs. Features register their own ops the same way
(tokenizer/registration.py, tokensurgeon/registration.py); this module holds only the engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..extensions import recipe_op, register_op
from ..plan import InputRef, TensorRecipe

Loader = Callable[[InputRef], torch.Tensor]


def get_op(name: str) -> Callable[[TensorRecipe, Loader], torch.Tensor]:
    """The function of recipe op `name`: the engine's own below, or one a feature registered (extensions.py)."""
    return recipe_op(name)


def stack_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """Stack inputs along a new dim 0, after concatenating each run of `group` inputs along `cat_dim`.

    params: `group` (default 1), `cat_dim` (default 0), `transpose` (swap the last two dims of each
    input first; default False). With group=2 this turns per-expert (gate, up) pairs into a fused
    [experts, 2*intermediate, hidden] tensor.
    """
    params = dict(recipe.params)
    group = int(params.get("group", 1))
    cat_dim = int(params.get("cat_dim", 0))
    transpose = bool(params.get("transpose", False))
    tensors = [load(ref) for ref in recipe.inputs]
    if transpose:
        tensors = [t.transpose(-1, -2) for t in tensors]
    if len(tensors) % group:
        raise ValueError(f"{recipe.name}: {len(tensors)} inputs do not split into groups of {group}")
    parts = [
        torch.cat(tensors[i : i + group], dim=cat_dim) if group > 1 else tensors[i]
        for i in range(0, len(tensors), group)
    ]
    return torch.stack(parts, dim=0)


register_op("stack", stack_op)


def perturb_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """One input plus seeded Gaussian noise, then scaled: `(x + noise_scale * N(0, 1)) * scale`.

    params: `noise_scale` and `scale` (either may be None). The noise comes from a generator seeded
    by `recipe.seed` (derived from the global seed and the output name), so the bytes do not depend
    on execution order or resumption. MoE assembly uses it for an expert's `noise_scale` and, on its
    down projection, `residual_scale`. Computed in float32 whatever the input dtype.
    """
    params = dict(recipe.params)
    noise_scale = params.get("noise_scale")
    scale = params.get("scale")
    tensor = load(recipe.inputs[0]).to(torch.float32)
    if noise_scale:
        if recipe.seed is None:
            raise ValueError(f"{recipe.name}: perturb with noise needs a seed")
        generator = torch.Generator().manual_seed(recipe.seed)
        tensor = tensor + torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * float(noise_scale)
    if scale is not None:
        tensor = tensor * float(scale)
    return tensor


def zeros_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """A tensor of zeros of the recipe's shape (no inputs): e.g. the q/k/v biases Qwen2-MoE expects
    when the dense donor (Llama, Mistral) has none; zero biases leave the attention unchanged."""
    return torch.zeros(recipe.shape, dtype=torch.float32)


register_op("perturb", perturb_op)
register_op("zeros", zeros_op)
