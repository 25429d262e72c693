"""Hub models a merge must download first: what `plan` lists, and the disk check before a merge fetches them.

`plan` builds the whole plan before anything large is fetched: a model not in the cache is read from the
Hub's metadata (its file sizes, its config and tokenizer, its safetensors headers over Range requests;
io.hub.headers_only), and the bytes still to download are listed per model and in total beside the plan,
with the free space of the cache and of OUT_DIR (one filesystem or two) counted for them and the output.
A merge checks the same before fetching gigabytes it could not then write out (the output estimated as
the largest model's weights, since the plan comes after the download there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..io import hub
from ..io.checkpoint import Checkpoint, hub_download
from .plan import Plan


def pending_downloads(refs: Iterable[str]) -> list[hub.Download]:
    """The hub models among `refs` that are not complete in the cache, with the files each still needs."""
    found = []
    for ref in dict.fromkeys(refs):
        download = hub_download(ref)
        if download is not None:
            found.append(download)
    return found


def check_download_space(downloads: list[hub.Download], out_dir: Path | None, force: bool) -> None:
    """One line (unless `force`) when the cache's filesystem cannot take the downloads, or OUT_DIR's, when it is
    the same one, cannot take them and the output together (estimated as the largest model's weights)."""
    if downloads:
        output = max(d.weight_bytes for d in downloads)
        hub.check_space(downloads, force, out_dir, output)


def plan_before_download(
    refs: Iterable[str], build: Callable[[], tuple[Plan, dict[str, Checkpoint]]], out_dir: Path | None
) -> tuple[Plan | None, dict[str, Checkpoint], dict[str, Any] | None]:
    """(plan, the inputs on disk, downloads report or None) for `plan`: `build` runs with hub models read from
    their headers on the Hub. The plan is None when a model's tensors cannot be listed without downloading it
    (`.bin` weights); the report then estimates the output as the largest model's weights."""
    refs = list(refs)
    try:
        with hub.headers_only():
            plan, checkpoints = build()
    except hub.HeadersUnavailable:
        return None, {}, downloads_report(pending_downloads(refs), out_dir)
    downloads = pending_downloads(refs)  # after the build: what it fetched (config, tokenizer) is not counted
    assert plan.estimate is not None
    report = downloads_report(downloads, out_dir, plan.estimate.bytes_written) if downloads else None
    on_disk = {ref: ck for ref, ck in checkpoints.items() if all(f.is_file() for f in ck.files)}
    return plan, on_disk, report


def downloads_report(
    downloads: list[hub.Download], out_dir: Path | None, output_bytes: int | None = None
) -> dict[str, Any]:
    """What `plan` shows for models still to download: per model and in total, and the free space where
    they and the output (`output_bytes`, else estimated as the largest model's weights) go."""
    total = sum(d.bytes for d in downloads)
    planned = output_bytes is not None
    output = output_bytes if output_bytes is not None else max((d.weight_bytes for d in downloads), default=0)
    cache = hub.cache_dir()
    disk = []
    cache_free = hub.free_space(cache)
    same = out_dir is not None and _device(cache) == _device(out_dir)
    disk.append({"path": str(cache), "free_bytes": cache_free, "needed_bytes": total + (output if same else 0)})
    if out_dir is not None and not same:
        disk.append({"path": str(out_dir), "free_bytes": hub.free_space(out_dir), "needed_bytes": output})
    for entry in disk:
        entry["enough"] = entry["free_bytes"] is None or entry["free_bytes"] >= entry["needed_bytes"]
    return {
        "models": [
            {"model": d.ref, "files": [{"name": n, "bytes": b} for n, b in d.files], "bytes": d.bytes}
            for d in downloads
        ],
        "download_bytes": total,
        "output_bytes": output,
        "output_planned": planned,
        "disk": disk,
    }


def render_downloads(report: dict[str, Any]) -> str:
    lines = ["to download from the Hugging Face Hub (not in the local cache):"]
    for d in report["models"]:
        lines.append(f"  {d['model']}: {len(d['files'])} file(s), {hub.human(d['bytes'])}")
    lines.append(f"  total: {hub.human(report['download_bytes'])}")
    for entry in report["disk"]:
        free = "free space unknown" if entry["free_bytes"] is None else f"{hub.human(entry['free_bytes'])} free"
        verdict = "enough" if entry["enough"] else "NOT enough"
        lines.append(f"disk at {entry['path']}: {free}, {hub.human(entry['needed_bytes'])} needed ({verdict})")
    if report["output_planned"]:
        lines.append(
            "(the time estimated above is the merge's, without the download; read speed is measured on the "
            "inputs already on disk)"
        )
    if not report["output_planned"]:
        lines.append(
            "output estimated as the largest model's weights: its `.bin` files must be downloaded before they can be "
            "planned (`mergesmith merge` downloads them first)"
        )
    return "\n".join(lines)


def _device(path: Path) -> int | None:
    try:
        return hub.existing_parent(path).stat().st_dev
    except OSError:
        return None
