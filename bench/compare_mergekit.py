"""mergesmith vs mergekit 0.1.5 on the same configs, the same checkpoints, in one run: speed, memory, equal outputs.

Why one script runs both tools, alternating: the machine is shared and its load drifts, so runs of the two tools
are interleaved (A B, B A, A B, ...) rather than batched, and medians are compared. Each run is a whole process
(startup included, as a user sees it). Both tools get the same YAML, bf16 output, the same output shard size and
no tokenizer copy; mergekit gets its best CPU options (``--lazy-unpickle``, and ``--clone-tensors`` where layers are
duplicated, which it otherwise discovers by failing a shard write and retrying). After the runs, the two outputs of
each case are compared tensor by tensor (bf16 tolerance, max abs diff reported), so a speed-up cannot hide a wrong
result.

Cases: 3-model ``linear``, 3-model ``ties`` and ``dare_ties`` (base + 2; dare_ties draws random masks, so its
outputs are compared by the statistics of their task vectors, see ``benchlib.compare_randomised``),
``passthrough`` frankenmerge with a duplicated layer range, 2-model ``slerp`` with layer-gradient ``t``.
Methods mergesmith does not register yet are skipped with a note.
``--scaling`` adds the linear merge at 0.25 B, 0.5 B and 1 B parameters.

Usage::

    python bench/compare_mergekit.py --with-mergekit                 # 1b, all cases, 3 runs each
    python bench/compare_mergekit.py --with-mergekit --scaling --methods linear,passthrough
    python bench/compare_mergekit.py --with-mergekit --methods "" --scaling --runs 2
    python bench/compare_mergekit.py --with-mergekit --cuda --runs 1     # both tools with --cuda, on a GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchlib as bl
from make_models import DEFAULT_ROOT, SIZES, ensure_models

DEFAULT_CASES = ("linear", "ties", "dare_ties", "passthrough", "slerp")
CASES = (*DEFAULT_CASES, "dare_linear", "della", "della_linear", "tsv", "iso_c", "iso_cts")  # the rest when asked
MERGESMITH_ONLY = ("tsv", "iso_c", "iso_cts")  # methods mergekit lacks: timed for mergesmith alone
# each tool draws its own masks: outputs compared by statistics, not elementwise
RANDOMISED = {"dare_ties", "dare_linear", "della", "della_linear"}
SCALING_SIZES = ("0.25b", "0.5b", "1b")


@dataclass
class CaseResult:
    """Both tools' runs of one (size, case), its floor, and the output comparison."""

    size: str
    case: str
    floor: bl.Floor
    tools: dict[str, bl.Summary] = field(default_factory=dict)
    diff: bl.Diff | None = None


class Tools:
    """How to invoke each tool; mergekit only when requested and installed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mergekit_yaml: Path | None = None
        if args.mergekit_yaml is not None:  # a venv made elsewhere (bench/gpu_check.sh makes one offline)
            self.mergekit_yaml = args.mergekit_yaml
        elif args.with_mergekit:
            self.mergekit_yaml = install_mergekit()

    @property
    def names(self) -> list[str]:
        return ["mergesmith", "mergekit"] if self.mergekit_yaml else ["mergesmith"]

    def command(self, tool: str, case: str, config: Path, out: Path) -> list[str]:
        a = self.args
        if tool == "mergesmith":
            return bl.mergesmith_cmd(config, out, a.out_shard_size, [*a.mergesmith_args.split(), *cuda(a)])
        assert self.mergekit_yaml is not None
        cmd = [str(self.mergekit_yaml), str(config), str(out), "--lazy-unpickle", "--out-shard-size",
               a.out_shard_size, "--no-copy-tokenizer", "--quiet", "--random-seed", "0"]
        if case == "passthrough":
            cmd.append("--clone-tensors")
        return cmd + a.mergekit_args.split() + cuda(a)


def cuda(args: argparse.Namespace) -> list[str]:
    """`--cuda` for both tools when asked: the same flag means the same to both (mergesmith reads mergekit's)."""
    return ["--cuda"] if args.cuda else []


def install_mergekit() -> Path:
    """Run scripts/mergekit_venv.sh (idempotent) and return the venv's ``mergekit-yaml``."""
    script = bl.REPO / "scripts" / "mergekit_venv.sh"
    bl.log(f"mergekit: {script} ...")
    out = subprocess.run(["bash", str(script)], check=True, stdout=subprocess.PIPE, text=True)
    python = Path(out.stdout.strip().splitlines()[-1])
    exe = python.parent / "mergekit-yaml"
    if not exe.exists():
        raise SystemExit(f"error: {exe} not found after {script}")
    return exe


class Runner:
    """Runs cases, caching floors by (input files, output size) since several cases share them."""

    def __init__(self, args: argparse.Namespace, tools: Tools, cold: bool) -> None:
        self.args = args
        self.tools = tools
        self.cold = cold
        self._floors: dict[tuple[tuple[str, ...], int], bl.Floor] = {}

    def floor(self, config: dict[str, Any], output_bytes: int) -> bl.Floor:
        files = [f for m in bl.config_models(config) for f in bl.weight_files(m)]
        key = (tuple(map(str, files)), output_bytes)
        if key not in self._floors:
            bl.log(f"  I/O floor: read {len(files)} files + write {bl.fmt_bytes(output_bytes)} ...")
            self._floors[key] = bl.measure_floor(
                files, output_bytes, self.args.out_root, cold=self.cold, runs=self.args.floor_runs
            )
        return self._floors[key]

    def run_case(self, size: str, case: str, models: list[Path], runs: int) -> CaseResult:
        a = self.args
        config = bl.make_config(case, models, a.dtype)
        cfg_path = bl.write_config(config, a.out_root / "configs" / f"{size}-{case}.yml")
        tools = [t for t in self.tools.names if t == "mergesmith" or case not in MERGESMITH_ONLY]
        outs = {t: a.out_root / f"{t}-{size}-{case}" for t in tools}
        summaries = {t: bl.Summary() for t in tools}
        for i in range(runs):
            order = tools if i % 2 == 0 else list(reversed(tools))
            for tool in order:
                if tool == "mergekit" and a.mergekit_runs is not None and i >= a.mergekit_runs:
                    continue
                bl.rm_out(outs[tool])
                bl.log(f"[{size} {case}] run {i + 1}/{runs} {tool} ...")
                r = bl.run_timed(self.tools.command(tool, case, cfg_path, outs[tool]), cold=self.cold,
                                 out_dir=outs[tool])
                bl.log(f"    wall {r.wall_s:.1f}s +sync {r.sync_s:.1f}s cpu {r.cpu_s:.1f}s "
                       f"rss {bl.fmt_bytes(r.maxrss)} anon {bl.fmt_bytes(r.peak_anon)} load {r.load1:.1f}")
                summaries[tool].runs.append(r)
        output_bytes = summaries["mergesmith"].runs[-1].output_bytes
        result = CaseResult(size, case, self.floor(config, output_bytes), summaries)
        if len(outs) == 2 and not a.no_check:
            bl.log(f"[{size} {case}] comparing outputs ...")
            if case in RANDOMISED:
                result.diff = bl.compare_randomised(outs["mergesmith"], outs["mergekit"], Path(config["base_model"]))
            else:
                result.diff = bl.compare_outputs(outs["mergesmith"], outs["mergekit"])
            if not result.diff.ok:
                bl.log(f"  {result.diff.verdict()}: only mergesmith {result.diff.only_a[:5]}, only mergekit "
                       f"{result.diff.only_b[:5]}, shape/dtype {result.diff.mismatched[:5]}")
        if not a.keep_outputs:
            for out in outs.values():
                bl.rm_out(out)
        return result


def ratio(a: float, b: float) -> str:
    return bl.fmt_ratio(a / b) if b else "-"


def comparison_rows(results: list[CaseResult], label_size: bool) -> list[list[str]]:
    """The headline table: medians of wall+sync and peak RSS per tool, their ratios, the floor, the check."""
    rows = []
    for r in results:
        ms = r.tools["mergesmith"]
        mk = r.tools.get("mergekit")
        ms_t = ms.med("total_s")
        mk_t = mk.med("total_s") if mk else float("nan")
        label = f"{r.size} {r.case}" if label_size else r.case
        if label_size:
            p = SIZES[r.size]
            label = f"{r.size} ({p['num_hidden_layers']}L h{p['hidden_size']})"
        rows.append([
            label,
            bl.fmt_bytes(r.floor.read_bytes),
            bl.fmt_s(r.floor.total_s),
            bl.fmt_s(ms_t),
            bl.fmt_s(mk_t),
            ratio(ms_t, mk_t),
            bl.fmt_ratio(ms_t / r.floor.total_s),
            bl.fmt_ratio(mk_t / r.floor.total_s),
            bl.fmt_bytes(ms.med("maxrss")),
            bl.fmt_bytes(mk.med("maxrss")) if mk else "-",
            ratio(ms.med("maxrss"), mk.med("maxrss")) if mk else "-",
            bl.fmt_bytes(ms.med("peak_anon")),
            bl.fmt_bytes(mk.med("peak_anon")) if mk else "-",
            f"{r.diff.max_abs:.3g}" if r.diff else "-",
            r.diff.verdict() if r.diff else "-",
        ])
    return rows


COMPARISON_HEADERS = [
    "case", "input", "floor s", "ms s", "mk s", "ms/mk", "ms/floor", "mk/floor", "ms RSS", "mk RSS", "RSS ms/mk",
    "ms anon", "mk anon", "max|diff|", "outputs",
]


def print_results(title: str, results: list[CaseResult], label_size: bool) -> None:
    print(title)
    print(bl.table(COMPARISON_HEADERS, comparison_rows(results, label_size)))
    print()
    print("details (medians):")
    rows = []
    for r in results:
        for tool, s in r.tools.items():
            rows.append(bl.detail_row(f"{tool} {r.size} {r.case}", s, r.floor))
    print(bl.table(bl.DETAIL_HEADERS, rows))
    print()


def build_parser() -> argparse.ArgumentParser:
    """The command line, also parsed by bench/gpu_check.py so its cases run with these defaults."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with-mergekit", action="store_true", help="install (scripts/mergekit_venv.sh) and run mergekit")
    ap.add_argument("--mergekit-yaml", type=Path, default=None,
                    help="run this mergekit-yaml (of a venv made elsewhere) instead of scripts/mergekit_venv.sh's")
    ap.add_argument("--cuda", action="store_true", help="pass --cuda to both tools")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--runs", type=int, default=3, help="runs per tool and case; medians reported (default 3)")
    ap.add_argument("--mergekit-runs", type=int, default=None,
                    help="runs of mergekit per case (default: --runs); fewer when its slow cases do not fit the time")
    ap.add_argument("--floor-runs", type=int, default=2, help="runs of the I/O floor measurement (default 2)")
    ap.add_argument("--methods", default=",".join(DEFAULT_CASES),
                    help=f"comma-separated cases of {', '.join(CASES)} ('' for none); "
                    f"default {','.join(DEFAULT_CASES)}")
    ap.add_argument("--scaling", action="store_true", help="also run linear at " + ", ".join(SCALING_SIZES))
    ap.add_argument("--scaling-runs", type=int, default=None, help="runs per tool per size (default: --runs)")
    ap.add_argument("--models-root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--out-root", type=Path, default=bl.DEFAULT_OUT_ROOT)
    ap.add_argument("--out-shard-size", default="5B", help="both tools' --out-shard-size (default 5B, both defaults)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="config dtype; float32 computes in fp32 and writes bf16 (out_dtype)")
    ap.add_argument("--mergesmith-args", default="", help="extra mergesmith merge arguments, e.g. '--threads 2'")
    ap.add_argument("--mergekit-args", default="", help="extra mergekit-yaml arguments, e.g. '--async-write'")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache before runs")
    ap.add_argument("--no-check", action="store_true", help="skip the output comparison")
    ap.add_argument("--keep-outputs", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write raw results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    cases = [c for c in args.methods.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r} (known: {', '.join(CASES)})")

    tools = Tools(args)
    available = set(bl.mergesmith_methods())
    notes: list[str] = []
    if tools.mergekit_yaml is None:
        notes.append("mergekit not run (pass --with-mergekit): mergesmith figures only")
    runnable = []
    for c in cases:
        if c in available:
            runnable.append(c)
        else:
            notes.append(f"{c}: SKIPPED, mergesmith has no `{c}` method yet (it has: {', '.join(sorted(available))})")
    cold = not args.warm and bl.can_drop_caches()
    if not args.warm and not cold:
        notes.append("cannot drop the page cache (not root?): runs and floors are warm-cache")
    runner = Runner(args, tools, cold)

    results: list[CaseResult] = []
    if runnable:
        models = ensure_models(args.size, args.models_root)
        for c in runnable:
            results.append(runner.run_case(args.size, c, models, args.runs))
    scaling: list[CaseResult] = []
    if args.scaling and "linear" in available:
        for size in SCALING_SIZES:
            reuse = [r for r in results if r.size == size and r.case == "linear"]
            if reuse:
                scaling.append(reuse[0])
                continue
            models = ensure_models(size, args.models_root)
            scaling.append(runner.run_case(size, "linear", models, args.scaling_runs or args.runs))

    head = (f"{' vs '.join(tools.names)}; bf16 llama checkpoints; config dtype {args.dtype}; out shard "
            f"{args.out_shard_size}; page cache {'dropped before every run and floor' if cold else 'warm'}; "
            "times are wall+sync (until the output is on disk), medians")
    print(head)
    for n in notes:
        print(f"note: {n}")
    print()
    if results:
        print_results(f"== {args.size}: {', '.join(r.case for r in results)} ({args.runs} runs each, alternating)",
                      results, label_size=False)
    if scaling:
        print_results("== scaling: 3-model linear merge by model size", scaling, label_size=True)
    if results or scaling:
        pythons = {"mergesmith": Path(sys.executable)}
        if tools.mergekit_yaml is not None:
            pythons["mergekit"] = tools.mergekit_yaml.parent / "python"
        starts = ", ".join(f"{t} {bl.import_torch_s(p, cold=cold):.1f} s" for t, p in pythons.items())
        print(f"start-up, in every run and not in the floor: `import torch` {'from a cold cache ' if cold else ''}"
              f"takes {starts} (medians of 3)")
    if args.json:
        raw = [
            {"size": r.size, "case": r.case, "floor": asdict(r.floor),
             "tools": {t: [asdict(x) for x in s.runs] for t, s in r.tools.items()},
             "diff": asdict(r.diff) if r.diff else None}
            for r in results + [s for s in scaling if s not in results]
        ]
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    failed = [r for r in results + scaling if r.diff is not None and not r.diff.ok]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
