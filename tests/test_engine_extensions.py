"""Features plug into the engine through engine/extensions.py: the engine imports no feature folder, and every
process has the features' recipe ops and vocabulary steps registered from `import mergesmith` on, cheaply."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mergesmith
from mergesmith.config import MergeConfiguration
from mergesmith.engine import extensions

FEATURES = ("moe", "tokenizer", "tokensurgeon", "lora", "raw", "multi", "evolve")
ENGINE = Path(mergesmith.__file__).parent / "engine"


def _imported(path: Path) -> list[str]:
    """Every module `path` imports, lazily or not, as an absolute mergesmith name where it is one."""
    package = "mergesmith." + ".".join(path.relative_to(ENGINE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: -node.level]
                found.append(".".join(base + ([node.module] if node.module else [])))
            else:
                found.append(node.module or "")
    return found


def test_the_engine_imports_no_feature_folder() -> None:
    upward = [
        f"{path.relative_to(ENGINE.parent)} imports {name}"
        for path in sorted(ENGINE.rglob("*.py"))
        for name in _imported(path)
        if name.split(".")[:2] in [["mergesmith", f] for f in FEATURES]
    ]
    assert not upward
    assert _imported(ENGINE / "execution" / "ops.py")  # the walk reads imports at all


def test_every_process_has_the_features_registered_without_heavy_imports() -> None:
    code = (
        "import sys\n"
        "import mergesmith.engine.extensions as e\n"
        "print(sorted(e._OPS), sorted(e._STEPS))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'typing') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["['transplant', 'transplant_merge', 'vocab_merge'] ['tokenizer', 'transplant']", "[]"]


def test_the_engine_finds_its_own_and_the_features_ops() -> None:
    from mergesmith.engine.execution.ops import get_op, stack_op
    from mergesmith.tokenizer.registration import vocab_merge_op

    assert get_op("stack") is stack_op
    assert get_op("vocab_merge") is vocab_merge_op


def _config(**fields: object) -> MergeConfiguration:
    return MergeConfiguration.model_validate({"merge_method": "linear", "models": [{"model": "a"}], **fields})


def test_a_config_gets_the_vocabulary_step_it_asks_for() -> None:
    assert extensions.vocabulary_step(_config()) is None
    chosen = extensions.vocabulary_step(_config(tokenizer_source="union"))
    assert chosen is not None and chosen.name == "tokenizer"
    chosen = extensions.vocabulary_step(_config(chat_template="chatml"))
    assert chosen is not None and chosen.name == "tokenizer"
    chosen = extensions.vocabulary_step(_config(tokenizer_source="transplant:a"))  # stands in for the tokenizer step
    assert chosen is not None and chosen.name == "transplant"
