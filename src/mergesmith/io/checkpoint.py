"""Lazy, validated reading of checkpoints: a model directory, a single file, a sharded index, or a
hub id (from the local Hugging Face cache, downloaded there when missing: io/hub.py).

Why hand-parse safetensors headers: we must know every tensor's dtype and shape before computing
(the plan fixes the output layout up front), and a malformed file must fail with one line naming the
file instead of a crash mid-merge. Tensor data is then read from a private memory map, so a tensor
costs no memory until its pages are touched, and nothing is copied unless a conversion needs it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from . import hub
from .bin_checkpoint import guard_bin, load_bin
from .dtypes import SAFETENSORS_TO_TORCH, dtype_size, from_torch
from .map_guard import GUARD
from .quantized import QuantizedTensor, dequantize, split
from .readahead import advise_in_pieces, piece_size

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, known without reading its data."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: Path
    data_offset: int = 0  # absolute byte offset in the file (safetensors only)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], bytes]:
    """Parse and validate a safetensors header: (tensors, metadata, raw header bytes).

    Rejects a truncated file, a header longer than the file, invalid JSON, unknown dtypes,
    offsets that disagree with the shape, overlap, or run past the end of the file.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: safetensors header length {header_len} is larger than the file ({size} bytes)"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON") from None
    except RecursionError:  # json recurses per nesting level
        raise CheckpointError(f"{path}: safetensors header is nested too deeply to read") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: safetensors `__metadata__` is not a JSON object")
    data_start = 8 + header_len
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if not _well_formed(entry):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry")
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in SAFETENSORS_TO_TORCH:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has a negative dimension in shape {list(shape)}")
        info = TensorInfo(name, dtype, shape, path, data_start + begin)
        if not (0 <= begin <= end) or end - begin != info.nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} offsets [{begin}, {end}) do not match its shape {list(shape)} and {dtype}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name!r} runs past the end of the file (offset {end} > {data_len} data bytes; "
                "truncated download?)"
            )
        tensors[name] = info
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file")
    return tensors, {str(k): str(v) for k, v in metadata.items()}, raw


def _well_formed(entry: Any) -> bool:
    """A header entry as the format defines it: a string dtype, a list of integer dimensions, two
    integer offsets. Anything else (floats, booleans, a string shape that would iterate as digits)
    is refused rather than coerced, as the reference safetensors reader does."""

    def is_int(v: Any) -> bool:
        return type(v) is int  # not bool, not float

    if not isinstance(entry, dict):
        return False
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    return (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(is_int(d) for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(is_int(o) for o in offsets)
    )


def _inside(root: Path, relative: str, index_path: Path) -> Path:
    """Resolve a shard path from an index, refusing any that escapes the model directory.

    The check is on the path as the index writes it (absolute, or climbing out with `..`), not on
    where symlinks lead: in the Hugging Face cache every file of a snapshot is a symlink into
    `blobs/`, outside the snapshot directory, and those shards must load.
    """
    normalized = os.path.normpath(relative)
    if os.path.isabs(normalized) or normalized == os.pardir or normalized.startswith(os.pardir + os.sep):
        raise CheckpointError(f"{index_path}: shard path {relative!r} escapes the model directory")
    candidate = root / normalized
    if not candidate.is_file():
        raise CheckpointError(f"{index_path}: shard file {relative!r} is missing")
    return candidate


def resolve_model_path(ref: str, weights: bool = True) -> Path:
    """A local path, or the snapshot of a hub id in the Hugging Face cache, downloaded when missing (io.hub:
    only the files a merge needs; refused in one line with `--offline` or HF_HUB_OFFLINE).

    `org/name@revision` (mergekit's spelling, also what a `revision:` key beside a model becomes) is that
    branch, tag or commit of the hub model; a revision on a local path that exists is ignored, as
    transformers ignores it there. Without `weights` (a tokenizer source), a hub model's config and tokenizer
    are enough: its weights are not downloaded for it."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    name, revision = split_revision(ref)
    if revision and Path(name).expanduser().exists():
        return Path(name).expanduser()
    if hub.looks_like_hub_id(name):
        return hub.fetch_snapshot(ref, name, revision) if weights else hub.fetch_small_files(ref, name, revision)
    raise CheckpointError(f"model {ref!r}: no such file or directory")


def split_revision(ref: str) -> tuple[str, str | None]:
    """(model, revision or None) of `org/name@revision`; one line for a malformed revision."""
    name, at, revision = ref.partition("@")
    if at and (not name or not revision or "@" in revision):
        raise CheckpointError(f"model {ref!r}: write one revision as `org/name@revision`")
    return name, revision or None


def hub_download(ref: str) -> hub.Download | None:
    """What a model reference still needs from the Hub before it can be read (None: nothing, or not a hub
    id); `model+lora` counts both parts. For `plan` and the disk check before a merge downloads."""
    parts = [ref]
    if "+" in ref and not Path(ref).expanduser().exists():
        parts = [p for p in ref.split("+") if p]
    total: hub.Download | None = None
    for part in parts:
        if Path(part).expanduser().exists():
            continue
        name, revision = split_revision(part)
        if not hub.looks_like_hub_id(name) or (revision and Path(name).expanduser().exists()):
            continue
        found = hub.pending_download(part, name, revision)
        if found is None:
            continue
        if total is None:
            total = found
        else:
            total.files += found.files
            total.weight_bytes += found.weight_bytes
    return total


class Checkpoint:
    """One input model: its config.json (if any) and a lazy map of its tensors."""

    def __init__(
        self,
        ref: str,
        root: Path,
        files: list[Path],
        tensors: dict[str, TensorInfo],
        config: dict[str, Any] | None,
        header_hashes: dict[Path, str],
        bin_state: dict[Path, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.ref = ref
        self.root = root
        self.files = files
        self.tensors = tensors
        self.config = config
        self._header_hashes = header_hashes
        self._bin_state = bin_state or {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._opened: dict[Path, Any] = {}  # the mapped files, open: their size is checked on the inode mapped
        self._lock = threading.Lock()
        # quantized weights (io/quantized.py): logical name -> its stored parts, whose headers `_stored` keeps
        self.quantized: dict[str, QuantizedTensor] = {}
        self._stored: dict[str, TensorInfo] = {}
        # weight files not downloaded yet (a hub model `plan` reads from its headers: HubHeaders): their size
        self.remote_sizes: dict[Path, int] = {}
        # the bytes each file must have: the end of the tensor data its header lists (a `.bin`: its size when read)
        self._sizes: dict[Path, int] = {f: 0 for f in files}
        for info in tensors.values():
            if info.file not in self._bin_state:
                self._sizes[info.file] = max(self._sizes.get(info.file, 0), info.data_offset + info.nbytes)
        for file, state in self._bin_state.items():
            self._sizes[file] = _size_of(file)
            start = guard_bin(file, state)
            if start is not None:
                weakref.finalize(self, GUARD.unregister, file, start)

    # ----- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, ref: str) -> Checkpoint:
        """Open `ref` (directory, file or hub id), validating every header up front.

        A `model+lora` reference is opened by `io.references.open_checkpoint`, which knows every form."""
        remote = _remote_weights(ref)
        if remote is not None:
            return HubHeaders.of(ref, remote)
        path = resolve_model_path(ref)
        root = path if path.is_dir() else path.parent
        config = _read_config(root / "config.json") if (root / "config.json").is_file() else None
        if path.is_dir():
            files = _weight_files(path)
        else:
            files = [path]
        tensors: dict[str, TensorInfo] = {}
        hashes: dict[Path, str] = {}
        bin_state: dict[Path, dict[str, torch.Tensor]] = {}
        for file in files:
            if file.suffix == ".safetensors":
                found, _meta, raw = read_safetensors_header(file)
                hashes[file] = hashlib.sha256(raw).hexdigest()
            else:
                state = load_bin(file)
                bin_state[file] = state
                found = {n: TensorInfo(n, from_torch(t.dtype), tuple(t.shape), file) for n, t in state.items()}
                hashes[file] = hashlib.sha256(
                    json.dumps({n: [i.dtype, list(i.shape)] for n, i in found.items()}, sort_keys=True).encode()
                ).hexdigest()
            _add_tensors(tensors, found, file)
        if not tensors:
            raise CheckpointError(f"model {ref!r}: no tensors found in {', '.join(str(f) for f in files)}")
        checkpoint = cls(ref, root, files, tensors, config, hashes, bin_state)
        checkpoint._dequantized(config)
        return checkpoint

    def _dequantized(self, config: dict[str, Any] | None) -> None:
        """Present quantized weights as their logical tensors (io/quantized.py; refuses unreadable formats):
        the stored headers stay in `_stored` for reading, size checks and read-ahead."""
        logical, quantized = split(
            self.ref, config, self.tensors, lambda info, dtype, shape: TensorInfo(info.name, dtype, shape, info.file)
        )
        if not quantized:
            return
        self._stored = dict(self.tensors)
        for name, q in quantized.items():  # the logical tensor's name may differ from its data's (MXFP4)
            logical[name] = TensorInfo(name, logical[name].dtype, q.shape, self._stored[q.data].file)
        self.tensors = logical
        self.quantized = quantized

    # ----- reading -------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"model {self.ref!r}: tensor {name!r} not found") from None

    def stored_nbytes(self, name: str) -> int:
        """Bytes of a tensor as stored in its files (a quantized one: its values and scales), what reading it costs."""
        q = self.quantized.get(name)
        if q is None:
            return self.info(name).nbytes
        return self._stored[q.data].nbytes + self._stored[q.scale].nbytes

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or its rows [start, end)), backed by the file's memory map (no copy unless the data is
        misaligned). A quantized tensor is dequantized here, only the quantization blocks that hold the rows."""
        q = self.quantized.get(name)
        if q is not None:
            return self._dequantize(q, rows)
        tensor = self._stored_tensor(self.info(name))
        return tensor if rows is None else tensor[rows[0] : rows[1]]

    def _dequantize(self, q: QuantizedTensor, rows: tuple[int, int] | None) -> torch.Tensor:
        data, scale = self._stored_tensor(self._stored[q.data]), self._stored_tensor(self._stored[q.scale])
        if rows is None or not q.shape:
            return dequantize(q, data, scale)
        start, end = rows[0], min(rows[1], q.shape[0])
        align = q.row_align
        lo, hi = start // align * align, min(-(-end // align) * align, q.shape[0])
        return dequantize(q, data[lo:hi], scale[lo // align : -(-hi // align)])[start - lo : end - lo]

    def _stored_tensor(self, info: TensorInfo) -> torch.Tensor:
        if info.file in self._bin_state:
            self._check_stored(info)
            return self._bin_state[info.file][info.name]
        dtype = SAFETENSORS_TO_TORCH[info.dtype]
        numel = 1
        for d in info.shape:
            numel *= d
        if numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        buf = self._map(info.file)
        self._check_stored(info)  # a view past the end of the file would raise SIGBUS when read
        if info.data_offset % torch.empty((), dtype=dtype).element_size():
            data = bytearray(buf[info.data_offset : info.data_offset + info.nbytes])
            return torch.frombuffer(data, dtype=dtype, count=numel).reshape(info.shape)
        return torch.frombuffer(buf, dtype=dtype, count=numel, offset=info.data_offset).reshape(info.shape)

    def byte_range(self, name: str) -> tuple[Path, int, TensorInfo] | None:
        """(file, absolute offset, info) of a tensor's bytes as stored, for readers that go around the
        memory map; None when its value is not simply those bytes (`.bin` pickles, adapted tensors)."""
        info = self.info(name)
        if info.file in self._bin_state or name in self.quantized:
            return None
        return info.file, info.data_offset, info

    def check_intact(self, name: str) -> None:
        """Refuse a tensor whose file now ends before its bytes, or whose mapped pages were read past the end of
        the file (io.map_guard put zeros there): truncated or replaced during the merge. One fstat."""
        q = self.quantized.get(name)
        parts = [self._stored[q.data], self._stored[q.scale]] if q is not None else [self.tensors.get(name)]
        for info in parts:
            if info is not None:
                self._check_stored(info)

    def _check_stored(self, info: TensorInfo) -> None:
        file = info.file
        needed = self._sizes.get(file, 0) if file in self._bin_state else info.data_offset + info.nbytes
        opened = self._opened.get(file)
        try:
            size = os.fstat(opened.fileno()).st_size if opened is not None else _size_of(file)
        except (OSError, ValueError):  # closed meanwhile
            size = _size_of(file)
        if size < needed or GUARD.faulted(file):
            raise CheckpointError(_end_of_file(file, size))

    def _map(self, file: Path) -> mmap.mmap:
        with self._lock:
            existing = self._maps.get(file)
            if existing is None:
                opened = open(file, "rb")  # noqa: SIM115 - kept open (closed by close() or when freed)
                try:
                    size = os.fstat(opened.fileno()).st_size
                    if size < self._sizes.get(file, 0):  # mapping it would fault on the missing pages
                        raise CheckpointError(_end_of_file(file, size))
                    # ACCESS_COPY: a private, writable view, so torch gets a writable buffer while the
                    # file itself can never be modified through it.
                    existing = mmap.mmap(opened.fileno(), 0, access=mmap.ACCESS_COPY)
                except BaseException:
                    opened.close()
                    raise
                self._maps[file] = existing
                self._opened[file] = opened
                start = ctypes.addressof(ctypes.c_char.from_buffer(existing))
                GUARD.register(file, start, start + len(existing))
                weakref.finalize(existing, GUARD.unregister, file, start)  # guarded while the pages are mapped
            return existing

    def advise(self, name: str, advice: str, start: int = 0, end: int | None = None) -> None:
        """Tell the kernel about bytes [start, end) of a tensor: "willneed" starts reading them ahead
        (I/O overlaps compute), "dontneed" drops them from this process's mapping once used, so
        resident memory stays at the tensors in flight instead of growing with everything read;
        "uncache" also drops them from the page cache.
        The file is mapped privately and never written, so dropped pages are simply read again
        if touched later. A no-op for `.bin` inputs and where madvise is unavailable.

        Why "uncache": under a memory limit smaller than the inputs (a 12.7 GB notebook merging 43 GB), pages
        a merge has used stay cached, and those read twice (two-pass methods) count as recently used, so the
        kernel evicts the inputs read ahead for the next tensors first and they are read again from the disk.

        A quantized tensor's range (of its logical bytes) is advised on its stored parts in proportion."""
        q = self.quantized.get(name)
        if q is not None:
            logical = self.tensors[name].nbytes
            for part in (self._stored[q.data], self._stored[q.scale]):
                lo = start * part.nbytes // max(logical, 1)
                hi = part.nbytes if end is None else -(-end * part.nbytes // max(logical, 1))
                self._advise_stored(part, advice, lo, hi)
            return
        info = self.tensors.get(name)
        if info is not None:
            self._advise_stored(info, advice, start, end)

    def _advise_stored(self, info: TensorInfo, advice: str, start: int, end: int | None) -> None:
        if info.file in self._bin_state or info.nbytes == 0:
            return
        flag = {"willneed": getattr(mmap, "MADV_WILLNEED", None), "dontneed": getattr(mmap, "MADV_DONTNEED", None)}
        option = flag.get("dontneed" if advice == "uncache" else advice)
        if option is None:
            return
        buf = self._map(info.file)
        lo = info.data_offset + start
        hi = info.data_offset + (info.nbytes if end is None else end)
        page = mmap.PAGESIZE
        if advice == "willneed":
            lo = lo // page * page
        else:  # only whole pages inside the range: neighbours may still be in use
            lo = -(-lo // page) * page
            hi = hi // page * page
        if hi <= lo:
            return
        try:
            if advice == "willneed":  # one call reads a few MB at most: advise the range piece by piece
                advise_in_pieces(lambda at, n: buf.madvise(option, at, n), lo, hi, piece_size(info.file))
                return
            buf.madvise(option, lo, hi - lo)
            if advice == "uncache" and hasattr(os, "posix_fadvise"):  # the kernel skips pages still mapped
                os.posix_fadvise(self._opened[info.file].fileno(), lo, hi - lo, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError):
            pass

    def identity(self) -> list[tuple[str, int, int, str]]:
        """(file name, size, mtime in ns, header hash) per weight file: what the resume fingerprint trusts (a file
        not downloaded yet: its size on the Hub, no mtime)."""
        out = []
        for f in self.files:
            if f in self.remote_sizes:
                out.append((f.name, self.remote_sizes[f], 0, self._header_hashes.get(f, "")))
                continue
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns, self._header_hashes.get(f, "")))
        return out

    @property
    def total_bytes(self) -> int:
        """The bytes its tensors take as stored (a quantized model: its quantized size)."""
        return sum(i.nbytes for i in (self._stored or self.tensors).values())

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # the maps close when the last tensor viewing them is freed
            for opened in self._opened.values():
                opened.close()
            self._opened.clear()


class HubHeaders(Checkpoint):
    """A hub model `plan` knows from the Hub before downloading it (io.hub.headers_only): its config and
    tokenizer are in the cache, its weight files may not be, their headers were read over HTTP. Tensors are
    listed (dtype, shape) but cannot be read: only a plan is built from it."""

    @classmethod
    def of(cls, ref: str, remote: hub.RemoteWeights) -> HubHeaders:
        root = remote.root
        config = _read_config(root / "config.json") if (root / "config.json").is_file() else None
        if (root / SAFETENSORS_INDEX).is_file():
            names = hub.index_shards(root / SAFETENSORS_INDEX) or []
        else:
            names = sorted({*remote.files, *(p.name for p in root.glob("*.safetensors"))})
        files = [root / name for name in names]
        tensors: dict[str, TensorInfo] = {}
        hashes: dict[Path, str] = {}
        sizes: dict[Path, int] = {}
        for name, file in zip(names, files):
            if name in remote.files:
                sizes[file], listed = remote.files[name]
                found: dict[str, TensorInfo] = {}
                for tensor, (dtype, shape, (begin, _end)) in listed.items():
                    if dtype not in SAFETENSORS_TO_TORCH:
                        raise CheckpointError(
                            f"model {ref!r}: {name}: tensor {tensor!r} has unsupported dtype {dtype!r}"
                        )
                    found[tensor] = TensorInfo(tensor, dtype, tuple(shape), file, begin)
                hashes[file] = hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()
            else:
                found, _meta, raw = read_safetensors_header(file)
                hashes[file] = hashlib.sha256(raw).hexdigest()
            _add_tensors(tensors, found, file)
        if not tensors:
            raise CheckpointError(f"model {ref!r}: no tensors found in its weight files")
        checkpoint = cls(ref, root, files, tensors, config, hashes, None)
        checkpoint.remote_sizes = sizes
        checkpoint._dequantized(config)
        return checkpoint


def _remote_weights(ref: str) -> hub.RemoteWeights | None:
    """A hub id not in the cache, while `plan` reads headers only (io.hub.headers_only); else None."""
    if not hub.SETTINGS.headers_only or Path(ref).expanduser().exists():
        return None
    name, revision = split_revision(ref)
    if not hub.looks_like_hub_id(name) or (revision and Path(name).expanduser().exists()):
        return None
    return hub.remote_weights(ref, name, revision)


def _add_tensors(tensors: dict[str, TensorInfo], found: dict[str, TensorInfo], file: Path) -> None:
    """Add one weight file's tensors to a model's; a name two files both hold is refused (which is meant?)."""
    for name, info in found.items():
        if name in tensors:
            raise CheckpointError(f"{file}: tensor {name!r} also appears in {tensors[name].file.name}")
        tensors[name] = info


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _end_of_file(path: Path, size: int) -> str:
    """The one line for an input that shrank under the merge (the direct-read path says the same)."""
    return (
        f"{path}: unexpected end of file at byte {size}, before the tensor data it holds "
        "(truncated or replaced during the merge?)"
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: is nested too deeply to read") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _weight_files(root: Path) -> list[Path]:
    """The weight files of a model directory, preferring safetensors, following an index when sharded."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index_path = root / index_name
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text(encoding="utf-8"))
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path}: not a valid index (needs a `weight_map` object)") from None
            except RecursionError:
                raise CheckpointError(f"{index_path}: is nested too deeply to read") from None
            ordered = list(dict.fromkeys(str(v) for v in weight_map.values()))
            return [_inside(root, rel, index_path) for rel in ordered]
    for single in (SAFETENSORS_SINGLE, BIN_SINGLE):
        if (root / single).is_file():
            return [root / single]
    loose = sorted(root.glob("*.safetensors"))
    if loose:
        return loose
    raise CheckpointError(
        f"{root}: no model weights found (expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} "
        f"or {BIN_INDEX})"
    )
