"""Direct (O_DIRECT) writes of a shard's bulk bytes: same bytes as buffered writes at any offset and order,
a clean fallback where the filesystem refuses, and errors that surface instead of a whole-looking file.

The chunk and threshold sizes are shrunk so that small tensors cross many block boundaries and chunks."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mergesmith.io import direct_write
from mergesmith.io.direct_write import ALIGN, DirectWriter
from mergesmith.io.dtypes import from_torch
from mergesmith.io.safetensors_writer import ShardWriter, file_checksum


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct_write, "CHUNK_BYTES", 4 * ALIGN)
    monkeypatch.setattr(direct_write, "MIN_DIRECT_BYTES", ALIGN)
    monkeypatch.setattr(direct_write, "BUFFERS", 2)
    monkeypatch.delenv(direct_write.ENV, raising=False)


def _direct_supported(directory: Path) -> bool:
    probe = directory / ".probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        writer = DirectWriter.open(probe, fd)
        if writer is not None:
            writer.close()
        return writer is not None
    finally:
        os.close(fd)
        probe.unlink()


def _tensors() -> dict[str, torch.Tensor]:
    """Odd sizes, so that no tensor starts or ends on a block boundary and several span many chunks."""
    g = torch.Generator().manual_seed(0)
    sizes = [3, 5000, 40_001, 7, 123_457, 1, 9_999, 70_003]
    out = {f"t{i:02d}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)}
    out["wide"] = torch.randn(301, 517, generator=g)  # float32, row-blocked below
    return out


def _entries(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(n, from_torch(t.dtype), tuple(t.shape)) for n, t in tensors.items()]


def _write_all(writer: ShardWriter, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    for name in names:
        if name == "wide":
            sink = writer.open_tensor(name)
            for rows in range(0, 301, 37):  # row blocks: consecutive writes that meet mid-block
                sink.write(tensors[name][rows : rows + 37])
            sink.close()
        else:
            writer.write(name, tensors[name])


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _count_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = DirectWriter._write_out

    def spy(self: DirectWriter, data: memoryview, offset: int, direct: bool) -> None:
        if direct:
            assert offset % ALIGN == 0 and len(data) % ALIGN == 0
            calls.append(len(data))
        original(self, data, offset, direct)

    monkeypatch.setattr(DirectWriter, "_write_out", spy)
    return calls


def test_direct_and_buffered_shards_are_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT; the buffered path is what runs here")
    tensors = _tensors()
    direct_calls = _count_direct(monkeypatch)
    names = list(tensors)[::-1]  # reverse order: every tensor's neighbours arrive before it

    writer = ShardWriter(tmp_path / "direct.safetensors", tmp_path / "direct.partial", _entries(tensors))
    assert writer._direct is not None
    _write_all(writer, tensors, names)
    direct_sum = writer.finish()
    assert sum(direct_calls) > 0.9 * sum(t.numel() * t.element_size() for t in tensors.values())

    monkeypatch.setenv(direct_write.ENV, "0")
    direct_calls.clear()
    plain = ShardWriter(tmp_path / "plain.safetensors", tmp_path / "plain.partial", _entries(tensors))
    assert plain._direct is None
    _write_all(plain, tensors, names)
    assert plain.finish() == direct_sum
    assert not direct_calls

    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert file_checksum(tmp_path / "direct.safetensors") == direct_sum
    for name, value in _read(tmp_path / "direct.safetensors").items():
        assert torch.equal(value, tensors[name]), name


def test_concurrent_writers_in_any_order(tmp_path: Path) -> None:
    tensors = _tensors()
    writer = ShardWriter(tmp_path / "m.safetensors", tmp_path / "m.partial", _entries(tensors))
    names = list(tensors)
    threads = [threading.Thread(target=_write_all, args=(writer, tensors, names[i::3])) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.finish()
    for name, value in _read(tmp_path / "m.safetensors").items():
        assert torch.equal(value, tensors[name]), name


def test_a_filesystem_that_refuses_direct_writes_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some filesystems accept O_DIRECT at open and fail the write with EINVAL: the bytes still land."""
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open already")
    tensors = _tensors()
    writer = ShardWriter(tmp_path / "m.safetensors", tmp_path / "m.partial", _entries(tensors))
    assert writer._direct is not None
    direct_fd = writer._direct._direct_fd
    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fd == direct_fd:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _write_all(writer, tensors, list(tensors))
    writer.finish()
    assert len(refused) == 1  # refused once, then never tried again
    for name, value in _read(tmp_path / "m.safetensors").items():
        assert torch.equal(value, tensors[name]), name


def test_a_failed_direct_write_surfaces_and_the_shard_is_never_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    tensors = _tensors()
    final = tmp_path / "m.safetensors"
    writer = ShardWriter(final, tmp_path / "m.partial", _entries(tensors))
    assert writer._direct is not None
    direct_fd = writer._direct._direct_fd
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fd == direct_fd:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match="Input/output error"):
        _write_all(writer, tensors, list(tensors))
        writer.sync()  # the journal must never vouch for bytes that did not land
        writer.finish()
    assert not final.exists()
    writer.abort()
    assert not (tmp_path / "m.partial").exists()


def test_resume_keeps_synced_tensors_and_fills_in_the_rest(tmp_path: Path) -> None:
    tensors = _tensors()
    names = list(tensors)
    final, partial = tmp_path / "m.safetensors", tmp_path / "m.partial"
    first = ShardWriter(final, partial, _entries(tensors))
    _write_all(first, tensors, names[::2])
    durable = first.sync()
    first.close()  # interrupted: the partial file stays
    assert set(durable) == set(names[::2])

    second = ShardWriter(final, partial, _entries(tensors), resume=durable)
    assert second.done == set(names[::2])
    _write_all(second, tensors, [n for n in names if n not in durable])
    second.finish()
    for name, value in _read(final).items():
        assert torch.equal(value, tensors[name]), name


def test_memory_stays_bounded_by_the_buffer_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However far the disk falls behind, a writer holds at most BUFFERS direct buffers."""
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    gate = threading.Event()
    original = DirectWriter._write_out

    def slow(self: DirectWriter, data: memoryview, offset: int, direct: bool) -> None:
        gate.wait(10)
        original(self, data, offset, direct)

    monkeypatch.setattr(DirectWriter, "_write_out", slow)
    tensors = {"big": torch.arange(200_000, dtype=torch.float32)}
    writer = ShardWriter(tmp_path / "m.safetensors", tmp_path / "m.partial", _entries(tensors))
    assert writer._direct is not None
    done = threading.Event()
    worker = threading.Thread(target=lambda: (writer.write("big", tensors["big"]), done.set()))
    worker.start()
    worker.join(1.0)
    assert not done.is_set()  # waiting for a free buffer, not queuing the whole tensor
    assert writer._direct._made == direct_write.BUFFERS
    gate.set()
    worker.join(10)
    assert done.is_set()
    writer.finish()
    assert torch.equal(_read(tmp_path / "m.safetensors")["big"], tensors["big"])


def test_network_and_unknown_filesystems_are_written_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS every direct write would wait for the server: such filesystems get the page cache."""
    assert direct_write.filesystem_type("/") is not None
    for kind in ("nfs4", "cifs", "fuse.sshfs", "zfs", "tmpfs", None):
        monkeypatch.setattr(direct_write, "filesystem_type", lambda _path, kind=kind: kind)
        writer = ShardWriter(tmp_path / "m.safetensors", tmp_path / "m.partial", _entries(_tensors()))
        assert writer._direct is None, kind
        writer.abort()


def test_filesystem_type_takes_the_longest_matching_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nserver:/x /data nfs4 rw 0 0\nfs /data2 xfs rw 0 0\n")
    real_open = open

    def fake_open(file, *args, **kwargs):
        return real_open(mounts if file == "/proc/self/mounts" else file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert direct_write.filesystem_type("/data/models/x") == "nfs4"
    assert direct_write.filesystem_type("/data2/x") == "xfs"
    assert direct_write.filesystem_type("/datax/y") == "ext4"


def test_a_sync_waits_only_for_writes_queued_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that keep writing must not starve the journal's periodic sync (it would never return)."""
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    gates = {0: threading.Event(), 4 * ALIGN: threading.Event()}
    original = DirectWriter._write_out

    def gated(self: DirectWriter, data: memoryview, offset: int, direct: bool) -> None:
        gates[offset].wait(10)
        original(self, data, offset, direct)

    monkeypatch.setattr(DirectWriter, "_write_out", gated)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8 * ALIGN)
    writer = DirectWriter.open(path, fd)
    assert writer is not None
    try:
        writer.write(memoryview(b"a" * (4 * ALIGN)), 0)  # queued before the sync
        drained = threading.Event()
        syncer = threading.Thread(target=lambda: (writer.drain(), drained.set()))
        syncer.start()
        writer.write(memoryview(b"b" * (4 * ALIGN)), 4 * ALIGN)  # queued after it, and stuck
        assert not drained.wait(0.3)
        gates[0].set()
        assert drained.wait(5)  # the later write is still waiting at its gate
        gates[4 * ALIGN].set()
        writer.drain()
        assert os.pread(fd, 8 * ALIGN, 0) == b"a" * (4 * ALIGN) + b"b" * (4 * ALIGN)
    finally:
        for gate in gates.values():
            gate.set()
        writer.close()
        os.close(fd)
