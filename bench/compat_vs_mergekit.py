"""Run the compatibility corpus (tests/compat/) through mergekit 0.1.5 and print each file's outcome beside
the one its header expects from mergesmith.

Why a bench script and not a test: it needs mergekit's own virtual environment and takes about a minute
per config (mergekit imports transformers and torch for each run). mergekit asks the hub for a repository's
file list even for a cached model, which an offline machine cannot answer, so the hub ids are replaced by
their snapshot directories in a copy of each config; mergekit ignores `revision:` beside a model (`@rev`
ids become that revision's snapshot), so the revision files compare only the merge itself.

    python bench/compat_vs_mergekit.py [--mergekit-bin ~/.cache/mergesmith/mergekit-venv/bin] [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_cache(work: Path) -> Path:
    """The corpus's Hugging Face cache (the same models the test builds), under `work`."""
    import tests.test_compat_corpus as corpus
    from tests.model_factory import ModelCache

    class Factory:
        def mktemp(self, name: str) -> Path:
            path = work / name
            path.mkdir(parents=True)
            return path

    return corpus.hub_cache.__wrapped__(ModelCache(work / "models"), Factory())  # type: ignore[attr-defined]


def snapshot(cache: Path, repo: str, ref: str = "main") -> Path | None:
    root = cache / ("models--" + repo.replace("/", "--"))
    refs = root / "refs" / ref
    return root / "snapshots" / refs.read_text().strip() if refs.is_file() else None


def localized(text: str, cache: Path) -> str:
    repos = [p.name[len("models--") :].replace("--", "/") for p in cache.iterdir() if p.name.startswith("models--")]
    for repo in sorted(repos, key=len, reverse=True):
        v2 = snapshot(cache, repo, "v2")
        if v2 is not None:
            text = text.replace(f"{repo}@v2", str(v2))
        text = re.sub(r"(?<![\w/])" + re.escape(repo) + r"(?![\w/-])", str(snapshot(cache, repo)), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit-bin", type=Path, default=Path.home() / ".cache/mergesmith/mergekit-venv/bin")
    parser.add_argument("names", nargs="*", help="only the corpus files whose name contains one of these")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compat-vs-mergekit-"))
    cache = build_cache(work)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for path in sorted((ROOT / "tests" / "compat").glob("*.yml")):
        if args.names and not any(n in path.name for n in args.names):
            continue
        text = path.read_text()
        config = work / path.name
        config.write_text(localized(text, cache))
        command = (re.search(r"^# command: (\S+)", text, re.M) or [None, "merge"])[1]
        extra = (re.search(r"^# args: (.*)$", text, re.M) or [None, ""])[1].replace("--strict", "").split()
        out = work / path.stem
        argv = {
            "merge": ["mergekit-yaml", config, out],
            "merge-raw": ["mergekit-pytorch", config, out],
            "moe": ["mergekit-moe", config, out],
            "multi": ["mergekit-multi", config, "--intermediate-dir", f"{out}-stages", "--out-path", out],
        }[command]
        argv[0] = args.mergekit_bin / str(argv[0])
        try:
            run = subprocess.run([str(a) for a in argv] + extra, capture_output=True, text=True, timeout=600, env=env)
            status = "ran" if run.returncode == 0 else "refused"
            last = (run.stderr.strip().splitlines() or [""])[-1][:120]
        except subprocess.TimeoutExpired:
            status, last = "timeout", ""
        expect = re.search(r"^# expect: (\S+)", text, re.M)
        print(f"{path.stem:40s} mergesmith: {expect[1] if expect else '?':8s} mergekit: {status:8s} {last}", flush=True)


if __name__ == "__main__":
    main()
