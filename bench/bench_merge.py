"""Time mergesmith alone on the generated checkpoints: a 3-model ``linear`` merge and a ``passthrough`` frankenmerge.

Why this exists next to ``compare_mergekit.py``: it needs no second tool, so it is the quick loop for engine work, and
it puts each merge next to its *I/O floor* (read every input byte once from a cold cache + write the output once with
fsync): a streaming merge is as fast as it can be when ``wall+sync / floor`` is near 1, and any gap above that is
CPU, memory traffic or scheduling the engine could still win back.

Usage::

    python bench/bench_merge.py                      # 1b models, 3 runs per case, medians
    python bench/bench_merge.py --size 0.25b --runs 1 --cases linear

See bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import benchlib as bl
from make_models import DEFAULT_ROOT, SIZES, ensure_models

CASES = ("linear", "passthrough")


def run_case(
    case: str, models: list[Path], args: argparse.Namespace, cold: bool
) -> tuple[bl.Summary, bl.Floor, int]:
    """All runs of one case, then its floor; returns (runs, floor, logical input bytes)."""
    config = bl.make_config(case, models, args.dtype)
    cfg_path = bl.write_config(config, args.out_root / "configs" / f"{args.size}-{case}.yml")
    out = args.out_root / f"mergesmith-{args.size}-{case}"
    extra: list[str] = []
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.max_memory:
        extra += ["--max-memory", args.max_memory]
    summary = bl.Summary()
    for i in range(args.runs):
        bl.rm_out(out)
        bl.log(f"[{case}] run {i + 1}/{args.runs} ...")
        r = bl.run_timed(bl.mergesmith_cmd(cfg_path, out, args.out_shard_size, extra), cold=cold, out_dir=out)
        bl.log(f"[{case}]   wall {r.wall_s:.1f}s +sync {r.sync_s:.1f}s cpu {r.cpu_s:.1f}s "
               f"rss {bl.fmt_bytes(r.maxrss)} anon {bl.fmt_bytes(r.peak_anon)}")
        summary.runs.append(r)
    output_bytes = summary.runs[-1].output_bytes
    if not args.keep_outputs:
        bl.rm_out(out)
    files = [f for m in bl.config_models(config) for f in bl.weight_files(m)]
    bl.log(f"[{case}] I/O floor ...")
    floor = bl.measure_floor(files, output_bytes, args.out_root, cold=cold, runs=args.runs)
    return summary, floor, floor.read_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--runs", type=int, default=3, help="runs per case; medians are reported (default 3)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--models-root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--out-root", type=Path, default=bl.DEFAULT_OUT_ROOT, help="outputs/configs (deleted after)")
    ap.add_argument("--out-shard-size", default="5B", help="output shard size for the merge (default 5B)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="config dtype; float32 computes in fp32 and writes bf16 (out_dtype)")
    ap.add_argument("--threads", type=int, default=None, help="mergesmith --threads (default: its own)")
    ap.add_argument("--max-memory", default=None, help="mergesmith --max-memory (default: none)")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache before runs")
    ap.add_argument("--keep-outputs", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write raw results here")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")

    models = ensure_models(args.size, args.models_root)
    cold = not args.warm and bl.can_drop_caches()
    if not args.warm and not cold:
        bl.log("note: cannot drop the page cache (not root?); runs and floor are warm-cache")

    rows: list[list[str]] = []
    raw: dict[str, object] = {}
    for case in cases:
        s, floor, in_bytes = run_case(case, models, args, cold)
        rows.append(bl.detail_row(case, s, floor))
        raw[case] = {"runs": [asdict(r) for r in s.runs], "floor": asdict(floor), "input_bytes": in_bytes}

    nparams = SIZES[args.size]
    print(f"mergesmith alone, {args.size} llama models ({nparams['num_hidden_layers']} layers, "
          f"hidden {nparams['hidden_size']}), bf16 in/out, config dtype {args.dtype}, "
          f"out shard {args.out_shard_size}, medians of {args.runs} run(s), page cache "
          f"{'dropped before each run and floor' if cold else 'NOT dropped (warm)'}")
    print(bl.table(bl.DETAIL_HEADERS, rows))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
