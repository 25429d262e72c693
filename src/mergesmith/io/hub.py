"""Hub ids: found in the local Hugging Face cache, or downloaded into it with `huggingface_hub`.

Why only some files: a model repository often holds the same weights twice (safetensors beside
`pytorch_model.bin`, or a `consolidated.safetensors` beside the shards its index lists), plus ONNX or
GGUF exports. A merge reads one weight format, the config and the tokenizer, so only those are fetched:
the safetensors index and the shards it lists (or the single file), `.bin` only where there is no
safetensors. The download itself is `hf_hub_download`'s, per file, so the cache layout, resuming a
transfer the connection dropped (a Range request), the `refs/` of a branch and the progress bars are the
client's own; an interrupted run keeps the files it finished, and a rerun fetches the rest.

A model already complete in the cache is used without asking the Hub anything (as with `HF_HUB_OFFLINE`),
so a rerun makes no request. `plan` reads a model it does not have from the Hub's metadata instead
(`headers_only`: config and tokenizer fetched, safetensors headers read by Range requests).

Settings (`--transformers-cache`, `--offline`, how progress is shown) are
process-wide, set once by the command line through `configure`, because every command reaches this
module through the same resolver (`checkpoint.resolve_model_path`) from many places.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, OutputError
from .model_files import CONFIG_FILES, TOKENIZER_FILES

ADAPTER_FILES = ("adapter_config.json",)
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


@dataclass
class HubSettings:
    """Where hub models are cached, whether the Hub may be asked, and how a download is shown."""

    cache_dir: Path | None = None  # None: huggingface_hub's own (HF_HUB_CACHE, HF_HOME)
    offline: bool = False  # --offline; HF_HUB_OFFLINE is read from huggingface_hub's constants
    progress_bars: bool = False  # huggingface_hub's tqdm bars (a terminal)
    report: Callable[[str], None] | None = None  # one line per event otherwise (None: silent)
    force: bool = False  # --force of the command under way: download even when the cache's disk looks too small
    headers_only: bool = False  # `plan`: fetch the small files and read the weights' headers over HTTP, no weights


SETTINGS = HubSettings()


def configure(**changes: Any) -> None:
    """Change the process-wide settings (`cache_dir`, `offline`, `progress_bars`, `report`, ...)."""
    for key, value in changes.items():
        if not hasattr(SETTINGS, key):
            raise TypeError(f"unknown hub setting {key!r}")
        setattr(SETTINGS, key, value)


@contextmanager
def forcing(force: bool) -> Iterator[None]:
    """Within the block, downloads skip the free-space check when `force` (a command's --force)."""
    before = SETTINGS.force
    SETTINGS.force = force
    try:
        yield
    finally:
        SETTINGS.force = before


@contextmanager
def headers_only() -> Iterator[None]:
    """Within the block (`plan`), a hub model not in the cache is read from the Hub without its weights: its
    config and tokenizer are fetched (a few KB) and each weight file's safetensors header is read with a Range
    request (`HfApi.parse_safetensors_file_metadata`), so the whole plan is shown before gigabytes are fetched."""
    before = SETTINGS.headers_only
    SETTINGS.headers_only = True
    try:
        yield
    finally:
        SETTINGS.headers_only = before


def offline() -> bool:
    """--offline, or HF_HUB_OFFLINE as huggingface_hub read it (the client refuses any request then)."""
    from huggingface_hub import constants

    return SETTINGS.offline or bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(SETTINGS.cache_dir or constants.HF_HUB_CACHE).expanduser()


def looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith("/")


@dataclass
class Download:
    """What one hub model still needs from the Hub: (file, bytes) pairs not yet in the cache."""

    repo: str
    revision: str | None
    files: list[tuple[str, int]] = field(default_factory=list)
    weight_bytes: int = 0  # the chosen weight files' size, cached or not: about what a merge of it writes

    @property
    def ref(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)


# ----- the cache -------------------------------------------------------------------------------------------
def cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The snapshot folder of `repo` at `revision` in the cache, or None (nothing of it there)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir(), local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure of a local look-up means "not cached"
        return None


def is_complete(root: Path) -> bool:
    """Whether a cached snapshot holds a whole model: every shard its index lists, or a single weight file
    (huggingface_hub links a file into a snapshot only once its download finished)."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = root / index_name
        if index.is_file():
            shards = index_shards(index)
            return shards is not None and all((root / s).is_file() for s in shards)
    if (root / "adapter_config.json").is_file() and not (root / "config.json").is_file():  # a PEFT adapter
        return any((root / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin"))
    return any((root / f).is_file() for f in (SAFETENSORS_SINGLE, BIN_SINGLE)) or any(root.glob("*.safetensors"))


def index_shards(index: Path) -> list[str] | None:
    """The shard files an index lists, in order of first mention (None: not a readable index)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return list(dict.fromkeys(str(v) for v in weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# ----- choosing the files ----------------------------------------------------------------------------------
def choose_files(sizes: dict[str, int], shards_of: Callable[[str], list[str]]) -> tuple[list[str], list[str]]:
    """(small files, weight files) a merge needs from a repository whose top-level files have `sizes`:
    config, tokenizer (or a PEFT adapter's config), and ONE weight format: the safetensors index and the
    shards it lists (`shards_of(index name)`), else model.safetensors, else the loose *.safetensors, and
    only without any safetensors the `.bin` index and its shards or pytorch_model.bin."""
    top = {name: size for name, size in sizes.items() if "/" not in name}
    small = [f for f in (*CONFIG_FILES, *ADAPTER_FILES, *TOKENIZER_FILES) if f in top]
    if "adapter_config.json" in top and "config.json" not in top:
        weights = [f for f in ("adapter_model.safetensors", "adapter_model.bin") if f in top][:1]
    elif SAFETENSORS_INDEX in top:
        small.append(SAFETENSORS_INDEX)
        weights = shards_of(SAFETENSORS_INDEX)
    elif SAFETENSORS_SINGLE in top:
        weights = [SAFETENSORS_SINGLE]
    elif any(name.endswith(".safetensors") for name in top):
        weights = sorted(name for name in top if name.endswith(".safetensors"))
    elif BIN_INDEX in top:
        small.append(BIN_INDEX)
        weights = shards_of(BIN_INDEX)
    elif BIN_SINGLE in top:
        weights = [BIN_SINGLE]
    else:
        weights = []
    return small, weights


# ----- talking to the Hub ----------------------------------------------------------------------------------
def _hub_failure(ref: str, repo: str, revision: str | None, exc: BaseException) -> CheckpointError:
    """The one line for anything the Hub (or the way to it) answered instead of the model."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        why = (
            f"is gated on the Hugging Face Hub: accept its terms on its page ({repo}) and log in "
            "(`hf auth login` or HF_TOKEN)"
        )
    elif isinstance(exc, RepositoryNotFoundError):
        why = (
            "is not a local path and not a model on the Hugging Face Hub (check the id; a private model needs "
            "`hf auth login` or HF_TOKEN)"
        )
    elif isinstance(exc, RevisionNotFoundError):
        why = f"has no revision {revision!r} on the Hugging Face Hub"
    elif isinstance(exc, OfflineModeIsEnabled):
        return _offline_failure(ref, repo, revision)
    elif isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        why = f"the Hugging Face Hub answered HTTP {status} ({_first_line(exc)})"
    else:
        why = (
            "is not in the local Hugging Face cache and the Hub cannot be reached "
            f"({exc.__class__.__name__}: {_first_line(exc)}); check the network or HF_ENDPOINT, or use a cached model"
        )
    return CheckpointError(f"model {ref!r}: {why}")


def _offline_failure(ref: str, repo: str, revision: str | None) -> CheckpointError:
    which = f" at revision {revision!r}" if revision else ""
    how, undo = ("--offline", "drop --offline") if SETTINGS.offline else ("HF_HUB_OFFLINE is set", "unset it")
    return CheckpointError(
        f"model {ref!r}: not a local path and not in the local Hugging Face cache{which}, and downloads are off "
        f"({how}): {undo} to download it, or download it first, e.g. "
        f"`hf download {repo}{f' --revision {revision}' if revision else ''}`"
    )


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _repo_sizes(repo: str, revision: str | None) -> dict[str, int]:
    """Top-level files of the repository and their sizes (an LFS file's real size), from the Hub's metadata."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    sizes: dict[str, int] = {}
    for sibling in info.siblings or []:
        size = sibling.lfs.size if sibling.lfs is not None else sibling.size
        sizes[sibling.rfilename] = int(size or 0)
    return sizes


def _fetch(repo: str, filename: str, revision: str | None) -> Path:
    """One file into the cache (a partial one resumes), with huggingface_hub's progress bar on a terminal
    and none elsewhere (the lines printed per file say what happens there)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not SETTINGS.progress_bars or SETTINGS.headers_only:
        disable_progress_bars()
    try:
        return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=cache_dir()))
    finally:
        if not was_disabled:
            enable_progress_bars()


def _shards_from_hub(repo: str, revision: str | None) -> Callable[[str], list[str]]:
    def shards_of(index_name: str) -> list[str]:
        index = _fetch(repo, index_name, revision)  # a few KB: the list of shards is in it
        shards = index_shards(index)
        if shards is None:
            raise CheckpointError(f"{index}: not a valid index (needs a `weight_map` object)")
        return shards

    return shards_of


def _in_cache(repo: str, filename: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=cache_dir(), revision=revision)
    return isinstance(found, str)


def _remote_files(
    ref: str, repo: str, revision: str | None, weights_too: bool = True
) -> tuple[dict[str, int], list[str], list[str]]:
    """(sizes, small files, weight files) of the repository as the Hub lists it; one line when it cannot.
    Without `weights_too` (a tokenizer source), no weight file is listed and none need be there."""
    try:
        sizes = _repo_sizes(repo, revision)
        small, weights = choose_files(sizes, _shards_from_hub(repo, revision) if weights_too else lambda _index: [])
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the client raises its own errors and httpx's
        raise _hub_failure(ref, repo, revision, exc) from None
    if not weights_too:
        return sizes, [f for f in small if not f.endswith(".index.json")], []
    if not weights:
        raise CheckpointError(
            f"model {ref!r}: the Hugging Face Hub repository has no model weights ({SAFETENSORS_SINGLE}, "
            f"{SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX})"
        )
    return sizes, small, weights


def _files_to_fetch(ref: str, repo: str, revision: str | None) -> tuple[dict[str, int], list[str], list[str]] | None:
    """None when `repo` is complete in the cache; else its files as _remote_files lists them (one line when
    offline, where they cannot be asked for)."""
    root = cached_snapshot(repo, revision)
    if root is not None and is_complete(root):
        return None
    if offline():
        raise _offline_failure(ref, repo, revision)
    return _remote_files(ref, repo, revision)


def pending_download(ref: str, repo: str, revision: str | None) -> Download | None:
    """What `repo` still needs from the Hub (None when complete in the cache); asks the Hub for its files'
    sizes, and fetches the small safetensors index to know the shards. Raises one line when offline or when
    the Hub does not answer with the model."""
    remote = _files_to_fetch(ref, repo, revision)
    if remote is None:
        return None
    sizes, small, weights = remote
    missing = [(f, sizes.get(f, 0)) for f in [*small, *weights] if not _in_cache(repo, f, revision)]
    return Download(repo, revision, missing, sum(sizes.get(f, 0) for f in weights))


class HeadersUnavailable(CheckpointError):
    """A model's tensors cannot be listed without downloading it (`.bin` weights have no header to read)."""


@dataclass
class RemoteWeights:
    """A hub model as `plan` sees it before downloading: the snapshot folder (config and tokenizer fetched) and,
    per weight file not yet in the cache, its size and its tensors (name -> dtype, shape, [begin, end))."""

    root: Path
    files: dict[str, tuple[int, dict[str, tuple[str, list[int], tuple[int, int]]]]]


def remote_weights(ref: str, repo: str, revision: str | None) -> RemoteWeights | None:
    """In `headers_only` mode, a hub model not complete in the cache as RemoteWeights (None otherwise: read it
    from the cache, or download it, as usual)."""
    if not SETTINGS.headers_only:
        return None
    remote = _files_to_fetch(ref, repo, revision)
    if remote is None:
        return None
    sizes, small, weights = remote
    if not all(w.endswith(".safetensors") for w in weights):
        raise HeadersUnavailable(f"model {ref!r}: its `.bin` weights must be downloaded before they can be planned")
    from huggingface_hub import HfApi

    api = HfApi()
    files = {}
    try:
        for name in small:
            root = _fetch(repo, name, revision).parent  # config, tokenizer, index: a few KB
        for name in weights:
            if _in_cache(repo, name, revision):
                continue
            meta = api.parse_safetensors_file_metadata(repo, name, revision=revision)
            tensors = {t: (i.dtype, list(i.shape), tuple(i.data_offsets)) for t, i in meta.tensors.items()}
            files[name] = (sizes.get(name, 0), tensors)
    except Exception as exc:  # noqa: BLE001 - as above
        raise _hub_failure(ref, repo, revision, exc) from None
    if root is None:
        raise HeadersUnavailable(f"model {ref!r}: nothing of it could be fetched")
    return RemoteWeights(root, files)


def fetch_snapshot(ref: str, repo: str, revision: str | None) -> Path:
    """The snapshot folder of `repo` at `revision` with the files a merge needs, downloading what is missing."""
    root = cached_snapshot(repo, revision)
    if root is not None and (is_complete(root) or offline()):
        return root  # offline, an incomplete snapshot is reported by the reader, naming the missing file
    download = pending_download(ref, repo, revision)
    if download is not None:
        _download(ref, repo, revision, download)
    root = cached_snapshot(repo, revision)
    if root is None or not is_complete(root):
        raise CheckpointError(
            f"model {ref!r}: the download did not complete (rerun to fetch the rest: finished files are kept)"
        )
    return root


def fetch_small_files(ref: str, repo: str, revision: str | None) -> Path:
    """The snapshot folder of `repo` with its config and tokenizer files, its weights not fetched: what a
    tokenizer source needs (a model already in the cache is used as it is)."""
    root = cached_snapshot(repo, revision)
    if root is not None and (is_complete(root) or any((root / f).is_file() for f in TOKENIZER_FILES)):
        return root
    if offline():
        if root is not None:
            return root  # the reader names what is missing
        raise _offline_failure(ref, repo, revision)
    sizes, small, _none = _remote_files(ref, repo, revision, weights_too=False)
    missing = [(f, sizes.get(f, 0)) for f in small if not _in_cache(repo, f, revision)]
    if missing:
        _download(ref, repo, revision, Download(repo, revision, missing))
    root = cached_snapshot(repo, revision)
    if root is None:
        raise CheckpointError(f"model {ref!r}: the Hugging Face Hub repository has no config or tokenizer files")
    return root


def _download(ref: str, repo: str, revision: str | None, download: Download) -> None:
    """Fetch the files `download` lists, after checking the cache's filesystem can take them (unless --force)."""
    check_space([download], force=SETTINGS.force)
    say = SETTINGS.report
    if say is not None:
        say(f"downloading {ref} from the Hugging Face Hub: {len(download.files)} file(s), {human(download.bytes)}")
    for name, size in download.files:
        if say is not None and not SETTINGS.progress_bars:
            say(f"  {ref}: {name} ({human(size)})")
        try:
            _fetch(repo, name, revision)
        except Exception as exc:  # noqa: BLE001 - the client raises its own errors and httpx's
            raise _hub_failure(ref, repo, revision, exc) from None


# ----- free space ------------------------------------------------------------------------------------------
def check_space(downloads: list[Download], force: bool, out_dir: Path | None = None, output_bytes: int = 0) -> None:
    """Refuse to start downloads (and, given `out_dir`, a merge of about `output_bytes`) that do not fit.
    The downloads go to the cache, the output to OUT_DIR: one filesystem or two, each checked for its own."""
    needs: dict[int, list[Any]] = {}

    def add(path: Path, amount: int, what: str) -> None:
        where = existing_parent(path)
        try:
            device = where.stat().st_dev
        except OSError:
            return
        entry = needs.setdefault(device, [where, 0, []])
        entry[1] += amount
        entry[2].append(f"{what} {human(amount)}")

    total = sum(d.bytes for d in downloads)
    if total:
        add(cache_dir(), total, "downloads")
    if out_dir is not None and output_bytes and total:
        add(out_dir, output_bytes, "output about")
    for where, amount, parts in needs.values():
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            continue
        if free < amount and not force:
            raise OutputError(
                f"{where}: not enough free space: {' + '.join(parts)} need {human(amount)}, the filesystem has "
                f"{human(free)} free (free space, set --transformers-cache elsewhere, or use --force to try anyway)"
            )


def free_space(path: Path) -> int | None:
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory yet to be made will be)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
