"""Merges in a memory cgroup the size of free Colab's RAM (issue 18): does each tool finish, in what time and memory.

Why a cgroup rather than ``--max-memory`` or ``ulimit``: free Colab gives a 12.7 GB machine, and a merge that goes past
that is killed by the kernel, whatever the tool believes. A cgroup with ``memory.max`` (v2) or
``memory.limit_in_bytes`` (v1) at that size and no swap reproduces exactly that: the kernel reclaims page cache at the
limit and OOM-kills the group when it cannot. Both tools get the same group, the same YAML and the same inputs.

Per run (one tool, one case), in the order given by ``--runs``:

* the page cache is dropped (root), a fresh child group is made beside this process's own (the same way as
  ``tests/test_memory_cgroup.py``), and the tool is started inside it (the launcher writes its pid to
  ``cgroup.procs`` before exec, so every byte the tool and its children touch is charged to the group);
* a sampler records every 0.2 s: the group's usage, its usage without file pages (what the kernel cannot drop), and
  the summed ``RssAnon`` of the group's processes;
* at the end: wall time (plus the ``sync`` after it), the group's own high-water mark (``memory.peak`` /
  ``memory.max_usage_in_bytes``: includes page cache, so any tool that streams 43 GB of inputs approaches the limit
  there and it says little), ``ru_maxrss`` of the tool's process, the group's OOM kills, the exit status, or a
  timeout;
* the output is checked tensor by tensor (one tensor in memory at a time): a digest of every tensor is saved, and
  when the other tool's digests of the same case exist they are compared (bit-equal or which tensors differ);
  ``linear`` outputs are also checked against an fp32 reference computed from the inputs. Then the output is
  deleted (the disk holds the 43.5 GB of 7b inputs and one output, not two).

Each run appends one JSON line to ``--results``; ``--table`` prints the markdown table from that file, so runs can be
made in separate invocations (a shared machine: hold the bench lock per run, not for an hour).

Usage::

    python bench/make_models.py --size 7b
    python bench/bench_7b_cgroup.py --runs mergesmith:linear,mergesmith:ties,mergekit:linear,mergekit:ties
    python bench/bench_7b_cgroup.py --size 1b --runs mergesmith:linear,mergesmith:ties
    python bench/bench_7b_cgroup.py --table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import benchlib as bl
import make_models

DEFAULT_LIMIT = 12_700_000_000  # free Colab's "12.7 GB"; decimal bytes, a little under the 12.7 GiB it really has
DEFAULT_RESULTS = bl.DEFAULT_OUT_ROOT / "cgroup-results.jsonl"
LINEAR_WEIGHTS = (0.5, 0.3, 0.2)  # benchlib.make_config("linear") weights, for the reference check


# --------------------------------------------------------------------------------------------------- the group


class Group:
    """A child memory cgroup (v1 or v2) with a hard limit and no swap; removed by `close`."""

    def __init__(self, limit: int, name: str) -> None:
        from mergesmith.runtime.memory_limits import cgroup_dirs

        if os.geteuid() != 0:
            raise SystemExit("error: creating a memory cgroup needs root")
        for version, parent, _top in cgroup_dirs():
            child = parent / name
            try:
                child.mkdir(exist_ok=True)
            except OSError:
                continue
            if version == 2 and not (child / "memory.max").exists():
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory")
                except OSError:
                    pass
            if (child / ("memory.max" if version == 2 else "memory.limit_in_bytes")).exists():
                self.version, self.path = version, child
                break
            child.rmdir()
        else:
            raise SystemExit("error: no writable memory cgroup (v1 or v2) here")
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # memory+swap at the same limit: no swap
                memsw.write_text(str(limit))
            (self.path / "memory.swappiness").write_text("0")
        self.limit = limit

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def _stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._read("memory.stat").splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def usage(self) -> tuple[int, int]:
        """(usage, usage without file pages): the second is what the kernel could not reclaim at the limit."""
        raw = self._read("memory.current" if self.version == 2 else "memory.usage_in_bytes").strip()
        used = int(raw) if raw.isdigit() else 0
        stat = self._stat()
        keys = ("active_file", "inactive_file") if self.version == 2 else ("total_active_file", "total_inactive_file")
        return used, max(0, used - sum(stat.get(k, 0) for k in keys))

    def pids(self) -> list[int]:
        return [int(p) for p in self._read("cgroup.procs").split()]

    def peak(self) -> int:
        raw = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes").strip()
        return int(raw) if raw.isdigit() else -1

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return -1

    def limit_hits(self) -> int:
        """How often usage reached the limit (v1 failcnt, v2 the ``max`` event): reclaim at the limit, not a kill."""
        if self.version == 1:
            raw = self._read("memory.failcnt").strip()
            return int(raw) if raw.isdigit() else -1
        for line in self._read("memory.events").splitlines():
            k, _, v = line.partition(" ")
            if k == "max":
                return int(v)
        return -1

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.kill_all()
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


class Sampler(threading.Thread):
    """Peaks of the group's usage, its non-file usage, and its processes' summed RssAnon, every `interval` s."""

    def __init__(self, group: Group, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.group, self.interval = group, interval
        self.peak_usage = self.peak_nonfile = self.peak_anon = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            used, nonfile = self.group.usage()
            anon = sum(bl.read_anon(p) for p in self.group.pids())
            self.peak_usage = max(self.peak_usage, used)
            self.peak_nonfile = max(self.peak_nonfile, nonfile)
            self.peak_anon = max(self.peak_anon, anon)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# --------------------------------------------------------------------------------------------------- one run


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_in_group(cmd: list[str], limit: int, timeout: float, tag: str) -> dict[str, Any]:
    """Run `cmd` inside a fresh limited group; the figures of `Group`/`Sampler`/wait4, or a timeout."""
    dropped = bl.drop_page_cache()
    group = Group(limit, f"mergesmith-bench-{tag}-{os.getpid()}")
    bl.DEFAULT_OUT_ROOT.mkdir(parents=True, exist_ok=True)
    usage_file = bl.DEFAULT_OUT_ROOT / f".cg-rusage-{os.getpid()}.json"
    errlog = bl.DEFAULT_OUT_ROOT / f".cg-stderr-{os.getpid()}.log"
    usage_file.unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    record: dict[str, Any] = {"limit": limit, "cgroup_version": group.version, "cold": dropped,
                              "uptime_before": uptime(), "load1": os.getloadavg()[0]}
    sampler = Sampler(group)
    timed_out = False
    try:
        with open(errlog, "wb") as err:
            launcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", bl.LAUNCHER,
                                         str(usage_file), str(group.path / "cgroup.procs"), *cmd],
                                        stdout=subprocess.PIPE, stderr=err, env=env)
            sampler.start()
            try:
                launcher.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                group.kill_all()
                launcher.wait()
        sampler.stop()
        t1 = time.perf_counter()
        os.sync()
        record["sync_s"] = time.perf_counter() - t1
        record.update(group_peak=group.peak(), oom_kills=group.oom_kills(), limit_hits=group.limit_hits(),
                      peak_usage_sampled=sampler.peak_usage, peak_nonfile=sampler.peak_nonfile,
                      peak_anon=sampler.peak_anon)
    finally:
        group.close()
    record["uptime_after"] = uptime()
    record["stderr_tail"] = errlog.read_text(errors="replace")[-2000:] if errlog.exists() else ""
    errlog.unlink(missing_ok=True)
    if usage_file.exists():
        ru = json.loads(usage_file.read_text())
        usage_file.unlink()
        record.update(wall_s=ru["wall"], exit_code=ru["code"], cpu_s=ru["utime"] + ru["stime"],
                      maxrss=ru["maxrss_kb"] * 1024)
    else:  # the launcher itself was killed (timeout, or the OOM killer picked it)
        record.update(wall_s=timeout if timed_out else float("nan"), exit_code=None, cpu_s=float("nan"), maxrss=-1)
    record["timed_out"] = timed_out
    record["finished"] = (not timed_out) and record["exit_code"] == 0
    return record


# --------------------------------------------------------------------------------------------------- output check


def digests(model_dir: Path) -> dict[str, str]:
    """sha256 of every tensor's raw bytes (with dtype and shape), one tensor in memory at a time."""
    import torch
    from safetensors import safe_open

    out: dict[str, str] = {}
    for name, path in sorted(bl._tensor_index(model_dir).items()):
        with safe_open(str(path), "pt") as fh:
            t = fh.get_tensor(name)
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().data)
        out[name] = h.hexdigest()
    return out


def linear_reference_check(
    out: Path, models: list[Path], names: list[str] | None = None, rtol: float = 2.0**-6
) -> dict[str, Any]:
    """The output's tensors `names` (all when None) against the fp32 weighted sum of the inputs, per element
    |x - ref| <= rtol * (|ref| + rms(ref)) (benchlib.compare_outputs' tolerance: about two bf16 ulps at the tensor's
    scale); also counts the tensors equal bit for bit to that sum rounded to the output's dtype."""
    import torch
    from safetensors import safe_open

    io = bl._tensor_index(out)
    ins = [bl._tensor_index(m) for m in models]
    res: dict[str, Any] = {"tensors": 0, "exact_bf16": 0, "out_of_tol": 0, "max_abs": 0.0, "worst": ""}
    for name in sorted(io) if names is None else names:
        ref = None
        for w, idx in zip(LINEAR_WEIGHTS, ins, strict=True):
            with safe_open(str(idx[name]), "pt") as fh:
                x = fh.get_tensor(name).float()
            ref = x.mul_(w) if ref is None else ref.add_(x, alpha=w)
        assert ref is not None
        with safe_open(str(io[name]), "pt") as fh:
            y = fh.get_tensor(name)
        res["tensors"] += 1
        if torch.equal(y, ref.to(y.dtype)):
            res["exact_bf16"] += 1
        d = (y.float() - ref).abs()
        m = float(d.max())
        if m > res["max_abs"]:
            res["max_abs"], res["worst"] = m, name
        rms = float(ref.square().mean().sqrt())
        if not bool((d <= rtol * (ref.abs() + rms)).all()):
            res["out_of_tol"] += 1
    return res


def check_output(
    out: Path, size: str, case: str, tool: str, models: list[Path], reference: bool
) -> dict[str, Any]:
    """Digest the output and compare with the other tool's digests of the same case. A linear output is also checked
    against the fp32 reference: every tensor with `reference`, else only the tensors that differ from the other
    tool's (at 7b the full check reads the 43.5 GB of inputs again: ~15 min here)."""
    t0 = time.perf_counter()
    mine = digests(out)
    store = bl.DEFAULT_OUT_ROOT / f"digests-{size}-{case}-{tool}.json"
    store.write_text(json.dumps(mine))
    check: dict[str, Any] = {"tensors": len(mine), "output_bytes": bl.dir_bytes(out)}
    other_tool = "mergekit" if tool == "mergesmith" else "mergesmith"
    other_store = bl.DEFAULT_OUT_ROOT / f"digests-{size}-{case}-{other_tool}.json"
    differing: list[str] | None = None
    if other_store.exists():
        theirs = json.loads(other_store.read_text())
        differing = sorted(k for k in mine if k in theirs and theirs[k] != mine[k])
        same = [k for k in mine if theirs.get(k) == mine[k]]
        check["vs_other"] = {
            "tool": other_tool, "equal": len(same), "of": len(set(mine) | set(theirs)),
            "only_here": sorted(set(mine) - set(theirs))[:5], "only_there": sorted(set(theirs) - set(mine))[:5],
            "differing": differing[:10],
        }
    if case == "linear" and (reference or differing):
        check["reference"] = linear_reference_check(out, models, None if reference else differing)
    check["check_s"] = time.perf_counter() - t0
    return check


# --------------------------------------------------------------------------------------------------- driver


def tool_cmd(tool: str, config: Path, out: Path, shard_size: str) -> list[str]:
    if tool == "mergesmith":
        return bl.mergesmith_cmd(config, out, shard_size)
    exe = Path(os.environ.get("MERGEKIT_VENV", Path.home() / ".cache/mergesmith/mergekit-venv")) / "bin/mergekit-yaml"
    if not exe.exists():
        raise SystemExit(f"error: {exe} not found; run scripts/mergekit_venv.sh first")
    return [str(exe), str(config), str(out), "--lazy-unpickle", "--out-shard-size", shard_size,
            "--no-copy-tokenizer", "--quiet", "--random-seed", "0"]


def one_run(tool: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    models = make_models.model_dirs(args.size, args.models_root)
    for m in models:
        if not (m / make_models.MARKER).is_file():
            raise SystemExit(f"error: {m} is not generated; run bench/make_models.py --size {args.size}")
    config = bl.write_config(bl.make_config(case, models), bl.DEFAULT_OUT_ROOT / f"cg-{args.size}-{case}.yml")
    out = bl.DEFAULT_OUT_ROOT / f"cg-{args.size}-{case}-{tool}"
    bl.rm_out(out)
    cmd = tool_cmd(tool, config, out, args.out_shard_size)
    bl.log(f"{args.size} {case} {tool}: {' '.join(cmd)}  [{uptime()}]")
    record: dict[str, Any] = {"size": args.size, "case": case, "tool": tool, "cmd": cmd,
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "input_bytes": sum(bl.dir_bytes(m) for m in models)}
    record.update(run_in_group(cmd, args.limit, args.timeout, f"{tool}-{case}"))
    bl.log(f"  finished={record['finished']} wall={record['wall_s']:.0f}s exit={record['exit_code']} "
           f"oom_kills={record['oom_kills']} peak anon={bl.fmt_bytes(record['peak_anon'])} "
           f"non-file={bl.fmt_bytes(record['peak_nonfile'])} maxrss={bl.fmt_bytes(record['maxrss'])}")
    if record["finished"] and not args.no_check:
        record["check"] = check_output(out, args.size, case, tool, models, args.reference)
        bl.log(f"  check: {json.dumps({k: v for k, v in record['check'].items()})}")
    if not args.keep_output:
        bl.rm_out(out)
    with open(args.results, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    return record


def verdict(r: dict[str, Any]) -> str:
    check = r.get("check")
    if not check:
        return "-"
    parts = []
    other = check.get("vs_other")
    if other:
        if other["equal"] == other["of"]:
            parts.append(f"bit-equal to {other['tool']}")
        else:
            parts.append(f"{other['of'] - other['equal']}/{other['of']} tensors differ from {other['tool']}")
    ref = check.get("reference")
    if ref:
        if ref["exact_bf16"] == ref["tensors"]:
            ok = "equal to it rounded to bf16"
        elif ref["out_of_tol"] == 0:
            ok = f"within tol, {ref['exact_bf16']}/{ref['tensors']} equal to it rounded"
        else:
            ok = f"{ref['out_of_tol']} tensors OUT OF TOL"
        parts.append(f"{ref['tensors']} tensors vs fp32 reference: {ok} (max abs {ref['max_abs']:.2g})")
    return "; ".join(parts) or "digested"


def _bytes(n: int) -> str:
    return "-" if n < 0 else bl.fmt_bytes(n)


def table(results: list[dict[str, Any]]) -> str:
    headers = ["size", "tool", "case", "finished", "wall s", "wall+sync s", "peak anon (tree)", "peak non-file (group)",
               "ru_maxrss", "group peak (incl. cache)", "OOM kills", "load before", "output"]
    rows = []
    for r in results:
        if r["timed_out"]:
            fin = f"no: did not finish in {r['wall_s'] / 60:.0f} min (killed)"
        elif r["finished"]:
            fin = "yes"
        else:
            fin = f"no: exit {r['exit_code']}" + (" (OOM-killed)" if r["oom_kills"] > 0 else "")
        rows.append([r["size"], r["tool"], r["case"], fin, bl.fmt_s(r["wall_s"]),
                     bl.fmt_s(r["wall_s"] + r.get("sync_s", 0.0)), _bytes(r["peak_anon"]),
                     _bytes(r["peak_nonfile"]), _bytes(r["maxrss"]), _bytes(r["group_peak"]),
                     str(r["oom_kills"]), f"{r['load1']:.1f}", verdict(r)])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="7b", choices=sorted(make_models.SIZES))
    ap.add_argument("--models-root", type=Path, default=make_models.DEFAULT_ROOT)
    ap.add_argument("--runs", default="mergesmith:linear,mergesmith:ties,mergekit:linear,mergekit:ties",
                    help="comma-separated tool:case, run in this order")
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="memory limit in bytes (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=2700.0, help="seconds per run before it is killed")
    ap.add_argument("--out-shard-size", default="5B")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON lines, appended (%(default)s)")
    ap.add_argument("--no-check", action="store_true", help="skip the output check")
    ap.add_argument("--keep-output", action="store_true")
    ap.add_argument("--reference", action="store_true",
                    help="check every tensor of linear outputs against the fp32 reference (slow at 7b)")
    ap.add_argument("--table", action="store_true", help="print the table of --results and exit")
    args = ap.parse_args(argv)
    if args.table:
        results = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
        results.sort(key=lambda r: (float(r["size"].rstrip("b")), r["tool"] != "mergesmith", r["case"]))
        print(table(results))
        return 0
    failed = 0
    for item in args.runs.split(","):
        tool, _, case = item.partition(":")
        if tool not in ("mergesmith", "mergekit") or case not in ("linear", "ties"):
            raise SystemExit(f"error: --runs entry {item!r}: want mergesmith|mergekit:linear|ties")
        r = one_run(tool, case, args)
        failed += not r["finished"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
