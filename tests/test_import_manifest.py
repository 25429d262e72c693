"""The merge command leaves the list of files its imports read, and the next start reads them ahead: the list
must name what Python will read (bytecode where it is kept), follow the interpreter, change only when the
imports do, and reading it ahead must skip what is gone and never raise."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.runtime import import_manifest
from mergesmith.runtime.cache_root import CACHE_ENV


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _read_by_import(module: str) -> str:
    """The file importing `module` afresh reads: its bytecode where Python keeps it, else its source."""
    source = sys.modules[module].__file__
    compiled = importlib.util.cache_from_source(source)
    return compiled if os.path.exists(compiled) else source


def test_the_list_names_the_bytecode_python_reads_in_import_order(cache: Path) -> None:
    import yaml  # noqa: F401 - imported for the list

    files = import_manifest.imported_files()
    yaml_file = _read_by_import("yaml")
    assert yaml_file in files
    manifest_module = _read_by_import("mergesmith.runtime.import_manifest")
    assert files.index(_read_by_import("mergesmith")) < files.index(manifest_module)
    assert len(files) == len(set(files))


def test_recorded_per_interpreter_and_rewritten_only_when_it_changes(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import_manifest.record()
    path = import_manifest.manifest_path()
    assert path.is_relative_to(cache) and path.read_text().splitlines() == import_manifest.imported_files()
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before - 10**9, before - 10**9))
    import_manifest.record()
    assert path.stat().st_mtime_ns == before - 10**9  # unchanged list: not rewritten
    monkeypatch.setattr(import_manifest, "imported_files", lambda: ["/elsewhere/a.pyc"])
    import_manifest.record()
    assert path.read_text() == "/elsewhere/a.pyc\n"
    assert not list(path.parent.glob("*.tmp"))
    monkeypatch.setattr(sys, "executable", "/another/venv/bin/python")
    assert import_manifest.manifest_path() != path


def test_read_ahead_asks_for_every_listed_file_and_skips_the_missing(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    present = []
    for k in range(20):
        present.append(tmp_path / f"m{k}.pyc")
        present[-1].write_bytes(b"\0" * 100)
    listed = [str(p) for p in present[:10]] + [str(tmp_path / "gone.pyc")] + [str(p) for p in present[10:]]
    path = import_manifest.manifest_path()
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(listed) + "\n")
    advised: list[str] = []
    real_advise = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    threads = import_manifest.read_ahead()
    assert 1 < len(threads) <= import_manifest.READERS
    for thread in threads:
        thread.join(10)
    assert sorted(advised) == sorted(str(p) for p in present)


def test_nothing_recorded_or_unreadable_reads_nothing(cache: Path) -> None:
    assert import_manifest.read_ahead() == []  # a first run
    path = import_manifest.manifest_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe not text")
    assert import_manifest.read_ahead() == []


def test_the_merge_command_records_its_imports_and_reads_them_ahead_next_time(
    cache: Path, tiny_models: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mergesmith.cli import main

    model = tiny_models("llama", seed=1)
    config = tmp_path / "merge.yml"
    merge = {"merge_method": "linear", "models": [{"model": str(model), "parameters": {"weight": 1.0}}]}
    config.write_text(yaml.safe_dump(merge))
    with pytest.raises(SystemExit) as done:
        main(["merge", str(config), str(tmp_path / "out"), "-q"])
    assert done.value.code == 0
    recorded = import_manifest.manifest_path().read_text().splitlines()
    assert _read_by_import("mergesmith.engine.execution.local_executor") in recorded
    assert _read_by_import("torch") in recorded
    started: list[list[threading.Thread]] = []
    real = import_manifest.read_ahead
    monkeypatch.setattr(import_manifest, "read_ahead", lambda: started.append(real()) or started[-1])
    with pytest.raises(SystemExit):
        main(["merge", str(config), str(tmp_path / "out2"), "-q"])
    assert started and started[0]
