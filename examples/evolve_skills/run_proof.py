"""The evolve proof: does `mergesmith evolve` find a merge better than each parent and than 50/50 linear?

    python examples/evolve_skills/run_proof.py [FIXTURES_DIR] [STORAGE_DIR] [MAX_FEVALS] [METHOD]

FIXTURES_DIR holds base/, add/, rev/ and the held-out add_eval.jsonl/rev_eval.jsonl
(tests/fixtures/evolve, built by make_fixtures.py). Scores every parent and the plain 50/50 linear merge
with the same built-in exact-match evaluator, runs the search (task_arithmetic over the two fine-tunes,
one weight per model per 2-layer group), and prints one table: combined = mean of the two accuracies.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from mergesmith.evolve import SearchOptions, run_search
from mergesmith.evolve.candidates import CandidateSettings
from mergesmith.evolve.config import load_evolve_config
from mergesmith.evolve.evaluators import resolve_builtin
from mergesmith.evolve.scoring import TokenizerSpec, score_candidate


def genome(fx: Path, method: str = "task_arithmetic") -> dict:
    return {
        "genome": {
            "models": [str(fx / "add"), str(fx / "rev")],
            "merge_method": method,
            "base_model": str(fx / "base"),
            "layer_granularity": 2,
        },
        "tasks": [
            {"name": "addition", "type": "exact_match", "data": str(fx / "add_eval.jsonl"), "metric": "acc"},
            {"name": "reverse", "type": "exact_match", "data": str(fx / "rev_eval.jsonl"), "metric": "acc"},
        ],
    }


def main() -> None:
    fx = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/evolve").resolve()
    storage = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/mergesmith-evolve-proof")
    max_fevals = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    method = sys.argv[4] if len(sys.argv) > 4 else "task_arithmetic"
    storage.mkdir(parents=True, exist_ok=True)
    path = storage.parent / f"{storage.name}-genome.yml"
    path.write_text(yaml.safe_dump(genome(fx, method)))
    config, _ = load_evolve_config(path)
    tasks = [resolve_builtin(t, None, str(path)) for t in config.tasks]
    tok = TokenizerSpec((str(fx / "add"), str(fx / "rev")), str(fx / "base"), None)
    settings = CandidateSettings(str(storage / "reference"), in_memory=True, threads=1)

    def linear(weights: dict[str, float]) -> dict:
        return {"merge_method": "linear", "dtype": "bfloat16",
                "models": [{"model": str(fx / m), "parameters": {"weight": w}} for m, w in weights.items()]}

    rows = {}
    for name, cfg in (("base", linear({"base": 1.0})), ("add (parent)", linear({"add": 1.0})),
                      ("rev (parent)", linear({"rev": 1.0})), ("linear 50/50", linear({"add": 0.5, "rev": 0.5}))):
        scores, _ = score_candidate(cfg, tasks, settings, tok, 64)
        rows[name] = scores
    started = time.monotonic()
    result = run_search(path, storage / "search", SearchOptions(max_fevals=max_fevals, random_seed=0, popsize=8,
                                                                overwrite=True))
    wall = time.monotonic() - started
    rows["evolved (best)"] = result.best["scores"]
    print(f"{'model':<16} {'addition':>9} {'reverse':>9} {'combined':>9}")
    for name, s in rows.items():
        a, r = s["addition"]["acc"], s["reverse"]["acc"]
        print(f"{name:<16} {a:>9.3f} {r:>9.3f} {(a + r) / 2:>9.3f}")
    print(f"evaluations: {len(result.history)} (best at #{result.best['evaluation']}); search wall time {wall:.0f} s")
    print("best parameters:", json.dumps(result.best["named_params"]))


if __name__ == "__main__":
    main()
