"""Assertions and readers shared by end-to-end tests.

They check merge outputs the way a user would find out they are broken: transformers refuses or silently
re-initialises weights (missing/unexpected keys), or the model produces NaN/inf. transformers is imported lazily so
tests that never touch a model do not pay for the import.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BENCH = Path(__file__).resolve().parents[1] / "bench"

DEFAULT_TOKEN_IDS: tuple[int, ...] = (1, 5, 6, 7, 8, 2)
"""bos, four ordinary tokens, eos: valid for every tiny vocabulary (>= 9 tokens)."""


def load_causal_lm(path: Path | str, **kwargs: Any) -> PreTrainedModel:
    """Load ``path`` with ``AutoModelForCausalLM.from_pretrained`` and fail on any missing/unexpected key.

    transformers only warns about missing keys and initialises them randomly, so a merge that drops or misnames a
    tensor would otherwise still "load" and produce garbage quietly.
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    problems = {name: sorted(info.get(name) or ()) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems["error_msgs"] = list(info.get("error_msgs") or ())
    assert not any(problems.values()), f"loading {path} reported problems: {problems}"
    model.eval()
    return model


def finite_logits(model: PreTrainedModel, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS) -> torch.Tensor:
    """Run one forward pass on ``token_ids`` and assert every logit is finite; returns the logits (1, seq, vocab).

    Returned so tests can also compare outputs (e.g. a linear merge of a model with itself reproduces its logits).
    """
    vocab_size = model.config.get_text_config().vocab_size
    assert max(token_ids) < vocab_size, f"token ids {list(token_ids)} out of range for vocab_size={vocab_size}"
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, len(token_ids), vocab_size), f"unexpected logits shape {tuple(logits.shape)}"
    assert torch.isfinite(logits).all(), f"non-finite logits: {int((~torch.isfinite(logits)).sum())} entries"
    return logits


def direct_io_works(path: Path) -> bool:
    """Whether `path` opens with O_DIRECT and its filesystem is one mergesmith reads and writes around the page
    cache (tests of those paths skip elsewhere: tmpfs, overlayfs)."""
    import os

    from mergesmith.io import direct_write

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return direct_write.direct_io_supported(path)


def ties_recipe(rows: int = 300) -> Any:
    """A TIES recipe of tensor "w" ([rows, 700] bf16) over models "a" (the base), "b" and "c": the feed tests' two-pass
    recipe (large enough for several row blocks once a test shrinks blocks.BLOCK_ELEMENTS)."""
    from mergesmith.engine.plan import InputRef, TensorRecipe

    return TensorRecipe(
        name="w",
        shape=(rows, 700),
        dtype="BF16",
        op="merge",
        inputs=tuple(InputRef(m, "w") for m in "abc"),
        method="ties",
        base_index=0,
        model_params=((), (("weight", 0.5), ("density", 0.5)), (("weight", 0.5), ("density", 0.5))),
        params=(("normalize", True), ("rescale", False), ("lambda", 1.0), ("int8_mask", False)),
    )


def weight_files(path: Path | str) -> list[Path]:
    """The weight files of the checkpoint in ``path`` (safetensors preferred, as transformers does), sorted."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    assert files, f"no weight files in {path}"
    return files


def read_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``path``, whatever its layout (single/sharded, safetensors/bin).

    Checks the index (when there is one) names exactly the tensors found, so a bad index fails here too.
    """
    from safetensors.torch import load_file

    path = Path(path)
    files = weight_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            part = load_file(file)
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
        overlap = state.keys() & part.keys()
        assert not overlap, f"tensors stored twice in {path}: {sorted(overlap)[:5]}"
        state.update(part)
    safetensors = files[0].suffix == ".safetensors"
    index = path / ("model.safetensors.index.json" if safetensors else "pytorch_model.bin.index.json")
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert set(weight_map) == set(state), f"{index} does not match the tensors stored in {path}"
        assert set(weight_map.values()) == {f.name for f in files}, f"{index} names other files than {path} holds"
    return state


def assert_state_dicts_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Same keys, shapes and dtypes, values within tolerance; the message names the first offending tensor."""
    assert set(actual) == set(expected), (
        f"missing {sorted(set(expected) - set(actual))[:5]}, unexpected {sorted(set(actual) - set(expected))[:5]}"
    )
    for name in sorted(expected):
        a, e = actual[name], expected[name]
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def run_cli(capsys: Any, *args: str | Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the `mergesmith` CLI run in-process (`capsys` is pytest's fixture)."""
    import pytest

    from mergesmith.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else 1
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *names: str, exit_code: int = 2) -> str:
    """Exit code `exit_code`, stderr exactly one line `error: ...` naming each of `names`, no traceback; a user error
    (exit 2) is never reported as an internal error."""
    lines = err.strip("\n").splitlines()
    assert code == exit_code, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in err
    if exit_code == 2:
        assert "internal error" not in lines[0], lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """Write a YAML config (keys in the order given, as a user writes them) and return its path."""
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def one_torch_thread() -> Iterator[None]:
    """A fixture body (`pytest.fixture(autouse=True, scope="module")(one_torch_thread)`): torch on one intra-op
    thread, put back afterwards. For tests of many small tensor operations, where on a busy 2-core machine
    torch's threads wait on each other in every operation and cost far more than the arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bench_module(name: str) -> Any:
    """bench/<name>.py as a module (`<name>_under_test`), bench/ first on sys.path: the bench scripts import each
    other by name, as they do when run."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
