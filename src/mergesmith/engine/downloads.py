"""Hub models a merge must download first: what `plan` lists, and the disk check before a merge fetches them.

Why before planning: a plan is built from the inputs' headers, which a model not yet downloaded does not
have on disk. So `plan` lists the downloads (from the Hub's file metadata: no weights are fetched) and
stops there, and a merge checks the free space of the cache (and of OUT_DIR, for about the largest
model's size) before fetching gigabytes it could not then write out.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..io import hub
from ..io.checkpoint import hub_download


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


def downloads_report(downloads: list[hub.Download], out_dir: Path | None) -> dict[str, Any]:
    """What `plan` shows for models still to download: per model and in total, and the free space where
    they and the output go."""
    total = sum(d.bytes for d in downloads)
    output = max((d.weight_bytes for d in downloads), default=0)
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
        "downloads": [
            {"model": d.ref, "files": [{"name": n, "bytes": b} for n, b in d.files], "bytes": d.bytes}
            for d in downloads
        ],
        "download_bytes": total,
        "output_bytes_estimate": output,
        "disk": disk,
    }


def render_downloads(report: dict[str, Any]) -> str:
    lines = ["to download from the Hugging Face Hub (not in the local cache):"]
    for d in report["downloads"]:
        lines.append(f"  {d['model']}: {len(d['files'])} file(s), {hub.human(d['bytes'])}")
    lines.append(f"  total: {hub.human(report['download_bytes'])}")
    for entry in report["disk"]:
        free = "free space unknown" if entry["free_bytes"] is None else f"{hub.human(entry['free_bytes'])} free"
        verdict = "enough" if entry["enough"] else "NOT enough"
        lines.append(f"disk at {entry['path']}: {free}, {hub.human(entry['needed_bytes'])} needed ({verdict})")
    lines.append(
        "the tensor plan is read from the models' headers: run `mergesmith merge` (it downloads them first), "
        "then `plan` again for the rest"
    )
    return "\n".join(lines)


def _device(path: Path) -> int | None:
    try:
        return hub.existing_parent(path).stat().st_dev
    except OSError:
        return None
