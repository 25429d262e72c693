"""Read-ahead must cover the whole range it is asked for: Linux reads at most one device read-ahead size
(a few MB) per WILLNEED call, so every caller splits its range into pieces no larger than that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mergesmith.io import readahead
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.runtime import warm_start


def _covered(calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (offset, length) calls into disjoint [start, end) intervals."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(calls):
        end = start + length
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


@pytest.mark.parametrize(("start", "end", "piece"), [(0, 10, 4), (3, 3, 4), (5, 6, 4), (4096, 1 << 20, 65536)])
def test_pieces_tile_the_range_exactly(start: int, end: int, piece: int) -> None:
    calls: list[tuple[int, int]] = []
    readahead.advise_in_pieces(lambda at, n: calls.append((at, n)), start, end, piece)
    assert all(0 < n <= piece for _, n in calls)
    assert sum(n for _, n in calls) == end - start  # no overlap, nothing twice
    assert _covered(calls) == ([(start, end)] if end > start else [])


def test_piece_size_is_bounded_and_safe_for_unknown_files(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x")
    size = readahead.piece_size(f)
    assert readahead.DEFAULT_PIECE <= size <= readahead.MAX_PIECE
    fd = os.open(f, os.O_RDONLY)
    try:
        assert readahead.piece_size(fd) == size
    finally:
        os.close(fd)
    assert readahead.piece_size(tmp_path / "missing") == readahead.DEFAULT_PIECE


class _RecordingMap:
    """Stands in for a checkpoint's mmap: records madvise calls, serves nothing else."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, option: int, start: int, length: int) -> None:
        self.calls.append((option, start, length))


def test_checkpoint_willneed_advises_the_whole_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3000), "big": torch.ones(100_000), "z": torch.zeros(10)}, str(path))
    ckpt = Checkpoint.open(str(path))
    info = ckpt.info("big")
    fake = _RecordingMap()
    ckpt._maps[info.file] = fake  # type: ignore[assignment]
    monkeypatch.setattr("mergesmith.io.checkpoint.piece_size", lambda _file: 8192)

    ckpt.advise("big", "willneed")
    assert len(fake.calls) > 1 and all(n <= 8192 for _, _, n in fake.calls)
    page = 4096
    start = info.data_offset // page * page
    assert _covered([(s, n) for _, s, n in fake.calls]) == [(start, info.data_offset + info.nbytes)]

    fake.calls.clear()
    ckpt.advise("big", "dontneed")  # releasing is one call: the kernel honours it whole
    assert len(fake.calls) == 1


def test_warm_start_reads_ahead_its_whole_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "model-1.safetensors", tmp_path / "model-2.safetensors"
    first.write_bytes(b"\0" * 100_000)
    second.write_bytes(b"\0" * 30_000)
    monkeypatch.setattr(readahead, "piece_size", lambda _path: 4096)
    pieces = warm_start._model_pieces([first, second], 120_000)
    assert all(n <= 4096 for _, _, n in pieces)
    assert _covered([(at, n) for p, at, n in pieces if p == first]) == [(0, 100_000)]
    assert _covered([(at, n) for p, at, n in pieces if p == second]) == [(0, 20_000)]  # the budget's rest
    assert _covered([(at, n) for _, at, n in warm_start._model_pieces([second], 1 << 30)]) == [(0, 30_000)]


def test_warm_start_takes_one_piece_of_each_model_in_turn() -> None:
    a = [(Path("a"), i, 1) for i in range(3)]
    b = [(Path("b"), i, 1) for i in range(1)]
    c = [(Path("c"), i, 1) for i in range(2)]
    order = [(p.name, at) for p, at, _ in warm_start._interleaved([a, b, c])]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]


def test_warm_start_keeps_few_pieces_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each advice beyond IN_FLIGHT waits for the oldest queued piece to arrive, so the queue stays short."""
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"\0" * 100_000)
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda _fd, at, n, _advice: events.append(("advise", at + n - 1)))
    monkeypatch.setattr(os, "pread", lambda _fd, n, at: events.append(("wait", at)) or b"\0" * n)
    pieces = [(shard, at, 1000) for at in range(0, 100_000, 1000)]
    warm_start._advise_paced(pieces)
    advised = [last for kind, last in events if kind == "advise"]
    assert advised == [at + 999 for _, at, _ in pieces]
    queued: list[int] = []
    for kind, last in events:
        if kind == "advise":
            queued.append(last)
        else:
            assert last == queued.pop(0)  # the oldest piece, in order
        assert len(queued) <= warm_start.IN_FLIGHT + 1


def test_warm_start_reads_torch_libraries_largest_first() -> None:
    pieces = warm_start._torch_library_pieces()
    files = list(dict.fromkeys(path for path, _, _ in pieces))
    assert files and all(path.parent.name == "lib" for path in files)
    sizes = [path.stat().st_size for path in files]
    assert sizes == sorted(sizes, reverse=True)
    assert _covered([(at, n) for path, at, n in pieces if path == files[0]]) == [(0, sizes[0])]


def test_executor_read_ahead_stays_a_window_past_the_admitted_recipe() -> None:
    """The executor's read-ahead is counted from the recipe being admitted: admitting recipes one by one moves
    the window one recipe on, instead of adding a whole window each time (which queued the whole model)."""
    from itertools import accumulate

    from mergesmith.engine.execution.local_executor import read_ahead_end

    def before(sizes: list[int]) -> list[int]:
        return list(accumulate(sizes, initial=0))

    sizes = [100] * 20
    end = 0
    ends = []
    for index in range(20):
        end = read_ahead_end(before(sizes), index, end, 250)
        ends.append(end)
        assert sum(sizes[index:end]) <= 250 + max(sizes)  # never more than the window (and the recipe that fills it)
    assert ends[:4] == [3, 4, 5, 6] and ends[-1] == 20
    assert read_ahead_end(before(sizes), 2, 10, 250) == 10  # what is advised stays advised
    assert read_ahead_end(before([0, 0, 500, 5]), 0, 0, 250) == 3  # empty (streamed) recipes cost nothing
    assert read_ahead_end(before([0] * 5), 1, 0, 250) == 5  # nothing mapped: the end at once
    assert read_ahead_end(before([300, 10]), 0, 0, 250) == 1  # a recipe over the window is its own window
    assert read_ahead_end(before([10, 10]), 2, 0, 250) == 2 and read_ahead_end(before([10]), 0, 0, 0) == 0
