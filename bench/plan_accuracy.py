"""`mergesmith plan`'s time estimate against the measured wall time of the merge it plans (issue 29, item 5).

Why: the estimate must be within 2x of what the merge really takes, start-up included (python, torch's import,
planning, the final fsync), for the quick start's merges and for the bench's. Each case runs as a user would:
`mergesmith plan CONFIG OUT --json` in a fresh process, then `mergesmith merge CONFIG OUT` in another, timed from
process start to exit (the plan's own disk probes warm the page cache a little, as they would for the user; the
page cache is not dropped: pass --cold to, as root). Printed per case: the estimate and its parts, the merge's wall
time (median of --runs), and wall / estimate, which should lie within [0.5, 2].

    python bench/plan_accuracy.py --demo                       # examples/linear.yml, frankenmerge.yml, ties, dare_ties
    python bench/plan_accuracy.py --size 0.25b                 # the bench's cases on its 0.25b models
    python bench/plan_accuracy.py --size 1b --runs 3           # the 1b set (~2.2 GB a model: an idle machine)
    python bench/plan_accuracy.py --demo --empty-cache         # every process with an empty numba cache

Bench cases use benchlib.make_config and the bench's options (`-q --no-copy-tokenizer --out-shard-size 5B
--random-seed 0`), so the times compare with bench/README.md's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl  # bench/ is on the path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
BENCH_CASES = ("linear", "ties", "dare_ties", "passthrough", "slerp")
TINY_CASES = ("ties", "dare_ties")
DEMO_CONFIGS = ("linear.yml", "frankenmerge.yml")


def _demo_configs(models_root: Path, work: Path) -> list[tuple[str, Path]]:
    """The quick start's configs with their `examples/models` paths pointed at `models_root`, and ties and
    dare_ties configs on the same tiny models."""
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_models.py"), str(models_root)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cases = []
    for name in DEMO_CONFIGS:
        text = (ROOT / "examples" / name).read_text().replace("examples/models", str(models_root))
        path = work / name
        path.write_text(text)
        cases.append((f"demo {name}", path))
    models = [models_root / f"tiny-llama-{i}" for i in range(3)]
    for method in TINY_CASES:
        cases.append((f"tiny {method}", bl.write_config(bl.make_config(method, models), work / f"tiny-{method}.yml")))
    return cases


def _bench_configs(size: str, models_root: Path | None, methods: list[str], work: Path) -> list[tuple[str, Path]]:
    from make_models import DEFAULT_ROOT, ensure_models

    models = ensure_models(size, models_root or DEFAULT_ROOT)
    return [(f"{size} {m}", bl.write_config(bl.make_config(m, models), work / f"{size}-{m}.yml")) for m in methods]


def _options() -> list[str]:
    """The bench's merge options after `merge CONFIG OUT` (benchlib.mergesmith_cmd), for plan too."""
    return bl.mergesmith_cmd(Path("c"), Path("o"), "5B")[4:]


def _plan(config: Path, out: Path, env: dict[str, str]) -> dict:
    cmd = bl.mergesmith_cmd(config, out, "5B")
    plan_cmd = [*cmd[: cmd.index("merge")], "plan", str(config), str(out), "--json",
                *[a for a in _options() if a != "-q"]]
    done = subprocess.run(plan_cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _merge_wall(config: Path, out: Path, env: dict[str, str], cold: bool) -> float:
    bl.rm_out(out)
    if cold:
        bl.drop_page_cache()
    start = time.perf_counter()
    subprocess.run(bl.mergesmith_cmd(config, out, "5B"), env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", action="store_true", help="the quick start's merges on the tiny models")
    parser.add_argument("--size", action="append", default=[], help="a bench/make_models.py size (repeatable)")
    parser.add_argument("--methods", default=",".join(BENCH_CASES), help="bench cases for --size")
    parser.add_argument("--runs", type=int, default=3, help="merges per case (median)")
    parser.add_argument("--models-root", type=Path, default=None, help="bench models' root (make_models.py --root)")
    parser.add_argument("--tiny-models", type=Path, default=Path(tempfile.gettempdir()) / "mergesmith-tiny-models")
    parser.add_argument("--empty-cache", action="store_true", help="a fresh NUMBA_CACHE_DIR for every process")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each merge (root)")
    args = parser.parse_args()
    if not args.demo and not args.size:
        args.demo = True

    rows = []
    with tempfile.TemporaryDirectory(prefix="mergesmith-plan-accuracy-") as tmp:
        work = Path(tmp)
        cases = _demo_configs(args.tiny_models, work) if args.demo else []
        for size in args.size:
            cases += _bench_configs(size, args.models_root, args.methods.split(","), work)
        for label, config in cases:
            walls = []
            for run in range(args.runs):
                env = dict(os.environ, HF_HUB_OFFLINE="1")
                env.pop("MERGESMITH_KERNELS", None)
                if args.empty_cache:
                    cache = work / f"numba-{len(rows)}-{run}"
                    cache.mkdir()
                    env["NUMBA_CACHE_DIR"] = str(cache)
                out = work / "out"
                report = _plan(config, out, env)
                walls.append(_merge_wall(config, out, env, args.cold))
                bl.rm_out(out)
            estimate = report["estimated_seconds"]
            parts = report.get("estimated_seconds_parts") or {}
            wall = statistics.median(walls)
            row = [label, f"{estimate:.1f}", f"{parts.get('startup', 0):.1f}", f"{parts.get('io', 0):.1f}",
                   f"{parts.get('compute', 0):.1f}", f"{wall:.1f}", f"{min(walls):.1f}-{max(walls):.1f}",
                   f"{wall / estimate:.2f}" if estimate else "-"]
            rows.append(row)
            bl.log("  ".join(row) + f"  (load {os.getloadavg()[0]:.1f})")
    headers = ["case", "estimate s", "start-up", "I/O", "compute", "wall s (median)", "range", "wall/estimate"]
    print(bl.table(headers, rows))
    ratios = [float(r[-1]) for r in rows if r[-1] != "-"]
    print(f"wall/estimate from {min(ratios):.2f} to {max(ratios):.2f} (issue 29 asks for 0.5-2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
