"""The GPU path (issue 33 item 4): the device memory budget, --max-gpu-memory, `plan --device cuda`, and the
pipelined transfers (engine/execution/device_transfer.py).

The budget, the options, the plan report and the staging pool's sizing run on the CPU with the device's free
memory faked (runtime.device_memory.free_memory_query) and CUDA faked available; the tests that need a real GPU
(the pipelined merge's bytes against the CPU's and the old device path's, the pinned pool reused) skip without
one.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import yaml

from mergesmith.cli import main
from mergesmith.engine.execution import device_transfer
from mergesmith.engine.execution.admission import DeviceBudget, MemoryBudget
from mergesmith.engine.execution.device_transfer import MIN_SLOT_BYTES, PinnedPool, slot_size, staging_dtype
from mergesmith.errors import ConfigError
from mergesmith.runtime import device_memory
from mergesmith.runtime.device_memory import DeviceLimit, device_limit

GB = 1_000_000_000
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA said to be available, with 80 GB total and 40 GB free on the device: nothing may touch the device."""
    calls: list[str] = []

    def free(device: str) -> tuple[int, int]:
        calls.append(device)
        return 40 * GB, 80 * GB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_memory, "free_memory_query", free)
    return calls


# ----- the budget ------------------------------------------------------------------------------------------------


def test_device_limit_is_the_free_memory_less_the_margin_unless_given():
    limit = device_limit("cuda", None, query=lambda _device: (40 * GB, 80 * GB))
    assert limit == DeviceLimit("cuda", 36 * GB, "90% of the 40.0 GB free on cuda")
    assert "the GPU budget of 36.0 GB (90% of the 40.0 GB free on cuda)" == limit.describe()

    def never(_device: str) -> tuple[int, int]:
        raise AssertionError("a given budget must not query the device")

    given = device_limit("cuda:1", 20 * GB, query=never)
    assert given is not None and given.limit == 20 * GB and given.describe() == "the --max-gpu-memory budget of 20.0 GB"
    assert device_limit("cpu", 20 * GB, query=never) is None and device_limit("mps", None, query=never) is None


def test_device_limit_reads_the_module_query_at_each_call(fake_cuda):
    assert device_limit("cuda", None).limit == 36 * GB
    assert fake_cuda == ["cuda"]


def test_admission_waits_for_device_bytes_as_for_host_bytes():
    budget = MemoryBudget(None)  # no host limit: only the device budget decides
    budget.device = DeviceBudget(100)
    stop = threading.Event()
    assert budget.acquire_first([1], stop, [60]) == 0
    # 60 more would be 120 > 100: the admission window skips to the one that fits
    assert budget.acquire_first([1, 1], stop, [60, 30]) == 1
    assert budget.device.in_flight == 90 and budget.device.peak == 90
    stop.set()  # nothing of 20 fits beside 90 on the device: a stop ends the wait
    assert budget.acquire_first([1], stop, [20]) is None
    budget.release(1, 60)
    budget.release(1, 30)
    assert budget.device.in_flight == 0 and budget.in_flight == 0
    stop.clear()
    assert budget.acquire_first([1], stop, [500]) == 0  # alone, an item runs whatever its size (plan-time checked)
    budget.release(1, 500)
    # without device costs (the CPU path) the device budget is not consulted
    assert budget.acquire_first([1, 1], stop) == 0 and budget.device.in_flight == 0


def test_device_budget_admits_recipes_in_parallel_threads():
    """Several workers releasing while the main thread waits: the device bytes in flight never pass the limit."""
    budget = MemoryBudget(None)
    budget.device = DeviceBudget(100)
    stop = threading.Event()
    seen: list[int] = []
    lock = threading.Lock()

    def work(device_cost: int) -> None:
        with lock:
            seen.append(budget.device.in_flight)
        budget.release(0, device_cost)

    threads = []
    for cost in [40, 70, 30, 30, 90, 10] * 3:
        assert budget.acquire_first([0], stop, [cost]) == 0
        thread = threading.Thread(target=work, args=(cost,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    assert max(seen) <= 100 and budget.device.peak <= 100 and budget.device.in_flight == 0


# ----- the options -----------------------------------------------------------------------------------------------


def _config(tmp_path: Path, tiny_models, method: str = "linear", **extra) -> Path:
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    doc = {"merge_method": method, "models": [{"model": str(a), "parameters": {"weight": 0.5}},
                                                {"model": str(b), "parameters": {"weight": 0.5}}]}
    if method == "slerp":
        doc = {"merge_method": "slerp", "base_model": str(a), "models": [{"model": str(a)}, {"model": str(b)}],
               "parameters": {"t": 0.5}}
    doc.update(extra)
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _exit(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


@pytest.mark.parametrize("value", ["abc", "0", "-3GB", "12XB"])
def test_max_gpu_memory_that_cannot_be_read_is_one_error_line(tmp_path, tiny_models, capsys, value):
    cfg = _config(tmp_path, tiny_models)
    assert _exit(["plan", str(cfg), f"--max-gpu-memory={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--max-gpu-memory" in err[0], err


def test_max_gpu_memory_on_the_cpu_is_a_note_not_an_error(tmp_path, tiny_models, capsys):
    cfg = _config(tmp_path, tiny_models)
    assert _exit(["plan", str(cfg), "--max-gpu-memory", "20GB", "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: `--max-gpu-memory` has no effect here: the arithmetic runs on cpu" in captured.err
    assert json.loads(captured.out)["gpu"] is None


def test_max_gpu_memory_reaches_the_merge_options_and_the_executor_settings():
    from mergesmith.engine.execution.local_executor import ExecutionSettings
    from mergesmith.options.convert import to_merge_options

    notes: list[str] = []
    kw = {"out_shard_size": "5B", "max_gpu_memory": "20GB", "max_memory": "8GB", "device": "cpu"}
    options = to_merge_options(kw, echo=notes.append)
    assert options.max_gpu_memory == 20 * GB and options.max_memory == 8 * GB
    assert ExecutionSettings.of(options).max_gpu_memory == 20 * GB
    assert len(notes) == 1 and "--max-gpu-memory" in notes[0]
    assert to_merge_options({"out_shard_size": "5B"}).max_gpu_memory is None
    with pytest.raises(ConfigError, match="--max-gpu-memory"):
        to_merge_options({"out_shard_size": "5B", "max_gpu_memory": "lots"})


def test_max_gpu_memory_is_an_option_of_every_merging_command():
    from mergesmith.cli import cli

    for name in ("merge", "plan", "merge-raw", "multi", "moe", "tokensurgeon"):
        command = cli.commands[name]
        assert any("--max-gpu-memory" in p.opts for p in command.params), name


# ----- plan --device cuda ----------------------------------------------------------------------------------------


def test_plan_on_cuda_shows_gpu_memory_and_time(tmp_path, tiny_models, capsys, fake_cuda):
    cfg = _config(tmp_path, tiny_models)
    assert _exit(["plan", str(cfg), "--device", "cuda", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory (estimate, 2 threads) on cuda:" in out
    assert "within the GPU budget of 36.0 GB (90% of the 40.0 GB free on cuda)" in out
    assert "GPU copies (estimate):" in out and "at an assumed 12.0 GB/s PCIe" in out
    assert fake_cuda  # the budget came from the (faked) device query


def test_plan_on_cuda_json_and_api_agree_on_the_budget(tmp_path, tiny_models, capsys, fake_cuda):
    import mergesmith

    cfg = _config(tmp_path, tiny_models)
    assert _exit(["plan", str(cfg), "--cuda", "--threads", "2", "--max-gpu-memory", "20GB", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["budget_bytes"] == 20 * GB and gpu["rates_assumed"] and gpu["pcie_bytes_per_s"] == 12e9
    assert 0 < gpu["peak_memory_bytes"] <= 2 * gpu["largest_tensor"]["working_bytes"]
    # a linear merge of two float32 models: both inputs cross as float32, the output comes back once
    planned = mergesmith.plan(str(cfg), threads=2, device="cuda", max_gpu_memory="20GB")
    report = planned.report
    assert report["gpu"]["budget_bytes"] == 20 * GB
    assert report["gpu"]["to_device_bytes"] == 2 * report["gpu"]["to_host_bytes"] > 0
    # the staging pool of each of the 2 threads: a slot per input and one for the output, each (tiny models) the
    # smallest pinned buffer
    assert report["gpu"]["pinned_bytes"] == 2 * 3 * MIN_SLOT_BYTES
    parts = report["estimated_seconds_parts"]
    assert parts["transfer"] == pytest.approx(report["gpu"]["transfer_seconds"])
    assert report["estimated_seconds"] >= parts["startup"] + max(parts["io"], parts["compute"]) - 1e-9


def test_plan_refuses_a_tensor_over_the_gpu_budget_in_one_line(tmp_path, tiny_models, capsys, fake_cuda):
    cfg = _config(tmp_path, tiny_models)
    assert _exit(["plan", str(cfg), "--device", "cuda", "--max-gpu-memory", "1K"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tensor ") and "the --max-gpu-memory budget of 1.00 KB" in err[0]
    assert "even in row blocks" in err[0]


def test_plan_names_a_tensor_merged_whole_that_cannot_fit(tmp_path, tiny_models, capsys, fake_cuda):
    base, other = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    cfg = tmp_path / "tsv.yml"
    models = [{"model": str(other)}, {"model": str(base)}]
    cfg.write_text(yaml.safe_dump({"merge_method": "tsv", "base_model": str(base), "models": models}))
    assert _exit(["plan", str(cfg), "--device", "cuda", "--max-gpu-memory", "300K"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: tensor 'model.embed_tokens.weight' needs 459 KB of GPU memory (merged whole by tsv), over the "
        "--max-gpu-memory budget of 300 KB; raise --max-gpu-memory, free the GPU, or merge on --device cpu"
    ]
    assert _exit(["plan", str(cfg), "--device", "cuda", "--max-gpu-memory", "500K"]) == 0


def test_merge_refuses_a_tensor_over_the_gpu_budget_before_writing(tmp_path, tiny_models, capsys, fake_cuda):
    cfg = _config(tmp_path, tiny_models)
    out = tmp_path / "out"
    assert _exit(["merge", str(cfg), str(out), "--device", "cuda", "--max-gpu-memory", "1K", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPU memory" in err[0] and "--max-gpu-memory" in err[0]
    assert not out.exists() or not any(out.glob("*.safetensors"))


# ----- the staging pool and the wire dtype (CPU) -----------------------------------------------------------------


def test_staging_dtype_widens_on_the_device_only_where_exact():
    assert staging_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # exact: cross as bf16, widen there
    assert staging_dtype(torch.float16, torch.float32) == torch.float16
    assert staging_dtype(torch.float32, torch.float64) == torch.float32
    assert staging_dtype(torch.float32, torch.bfloat16) == torch.bfloat16  # rounding: on the CPU, as before
    assert staging_dtype(torch.float16, torch.bfloat16) == torch.bfloat16
    assert staging_dtype(torch.float32, torch.float32) == torch.float32


def test_slot_sizes_are_powers_of_two_within_the_cap():
    assert slot_size(1, 64 << 20) == MIN_SLOT_BYTES
    assert slot_size(MIN_SLOT_BYTES + 1, 64 << 20) == 2 * MIN_SLOT_BYTES
    assert slot_size(5 << 20, 6 << 20) == 6 << 20  # rounded up past the cap: the cap
    assert slot_size(7 << 20, 6 << 20) == 0


class _Event:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_pinned_pool_grows_to_the_largest_block_and_reuses_it():
    pinned: list[int] = []

    def pin(nbytes: int) -> torch.Tensor:  # stands for page-locking (no CUDA here)
        pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = PinnedPool(cap=8 << 20, pin=pin)
    first = pool.take(0, 100)
    assert first is not None and first.numel() == 100 and pinned == [MIN_SLOT_BYTES]
    again = pool.take(0, 4000)
    assert again is not None and again.data_ptr() == first.data_ptr() and pool.pinned_calls == 1  # reused
    grown = pool.take(0, 3 << 20)
    assert grown is not None and pinned[-1] == 4 << 20 and pool.held == 4 << 20  # the old one dropped
    assert pool.take(0, 100) is not None and pool.pinned_calls == 2  # a smaller block keeps the larger buffer
    assert pool.take(1, 5 << 20) is None  # 4 MiB held + 5 MiB > the 8 MiB cap: not staged
    assert pool.take(1, 3 << 20) is not None and pool.held == 8 << 20
    # a slot whose copy is in flight is waited for before it is handed out again
    event = _Event()
    pool.fence(1, event)
    assert pool.take(1, 10) is not None and event.waited == 1
    assert pool.take(1, 10) is not None and event.waited == 1  # once


class _Stream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _cpu_lane(monkeypatch) -> device_transfer.DeviceLane:
    """A lane whose 'device' is the CPU, its stream and events stubbed: the staging and conversion logic runs."""
    monkeypatch.setattr(device_transfer, "_recorded", lambda _stream: _Event())
    lane = object.__new__(device_transfer.DeviceLane)
    lane.device, lane.stream = torch.device("cpu"), _Stream()
    lane.pool = PinnedPool(cap=64 << 20, pin=lambda n: torch.empty(n, dtype=torch.uint8))
    return lane


@pytest.mark.parametrize(
    "source,compute",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
     (torch.float32, torch.float32), (torch.int64, torch.float32), (torch.float16, torch.bfloat16)],
)
def test_lane_staging_gives_the_plain_conversion_values(monkeypatch, source, compute):
    lane = _cpu_lane(monkeypatch)
    torch.manual_seed(0)
    host = (torch.randn(300, 7, dtype=torch.float64) * 1e3).to(source)
    moved = lane.to_device(host, compute, 0)
    assert moved.dtype == compute and torch.equal(moved, host.to(dtype=compute))
    assert moved.data_ptr() != host.data_ptr()  # staged: the input's own memory is not kept
    back = lane.to_host(moved, torch.bfloat16, lend=True)
    assert torch.equal(back, moved.to(torch.bfloat16)) and lane.stream.synchronized == 1
    kept = lane.to_host(moved, torch.bfloat16, lend=False)
    assert kept.data_ptr() != back.data_ptr() and torch.equal(kept, back)  # a copy, not the pool's buffer
    assert lane.pool.pinned_calls == 2  # one input slot, one output slot: reused by the second call


def test_lane_copies_a_block_over_the_cap_without_staging(monkeypatch):
    lane = _cpu_lane(monkeypatch)
    lane.pool.cap = 1 << 20
    big = torch.randn(1 << 19)  # 2 MiB of float32
    assert torch.equal(lane.to_device(big, torch.float32, 0), big) and lane.pool.pinned_calls == 0
    assert torch.equal(lane.to_host(big, torch.float32, lend=True), big) and lane.pool.pinned_calls == 0


def test_off_cuda_there_is_no_lane():
    assert device_transfer.lane_for(torch.device("cpu")) is None
    assert device_transfer.lane_for(torch.device("meta")) is None


def test_device_transfer_bytes_count_inputs_in_their_wire_dtype(tmp_path, tiny_models):
    import mergesmith
    from mergesmith.engine.time_estimate import device_transfer_bytes

    cfg = _config(tmp_path, tiny_models, dtype="bfloat16")  # float32 inputs merged in bfloat16
    plan = mergesmith.plan(str(cfg), threads=1).plan
    assert plan.compute_dtype == "BF16"
    to_device, to_host = device_transfer_bytes(plan)
    merged = [r for r in plan.recipes if r.op == "merge"]
    assert merged
    # rounded to bf16 on the CPU (as the old path did), so two bytes an entry cross for each of the two inputs
    assert to_device == sum(r.numel() * 2 * 2 for r in merged)
    assert to_host == sum(r.numel() * 2 for r in merged)


# ----- on a GPU --------------------------------------------------------------------------------------------------

EXACT_ON_GPU = ["linear", "dare_ties", "dare_linear", "della", "della_linear"]
"""Methods whose merged bytes on a GPU are the CPU's (issue 33 items 2 and 3): elementwise arithmetic in the same
order, the keyed masks drawn on the device with the CPU's bits, the L1 norms of the rescale device-independent
(reductions.BlockedTotal(invariant=True))."""

CLOSE_ON_GPU = ["ties", "breadcrumbs", "slerp"]
"""Methods whose bytes on a GPU may differ from the CPU's, by a stated amount (_assert_gpu_close): ties and
breadcrumbs rank magnitudes by the device's sort, which orders equal magnitudes at the trim threshold otherwise
than the CPU's (the CPU path replays mergekit's CPU sort, the device path sorts as mergekit --cuda does); slerp's
norms and dot product are reductions the GPU adds in another order."""

GPU_METHODS = EXACT_ON_GPU + CLOSE_ON_GPU


def _method_config(tmp_path: Path, tiny_models, method: str) -> Path:
    base = tiny_models("llama", seed=1)
    a, b = tiny_models.derive(base, seed=2, scale=0.01), tiny_models.derive(base, seed=3, scale=0.01)
    if method == "slerp":
        doc = {"merge_method": "slerp", "base_model": str(base), "models": [{"model": str(base)}, {"model": str(a)}],
               "parameters": {"t": 0.3}}
    else:
        params = {"weight": 0.6}
        if method != "linear":
            params["density"] = 0.5
        if method.startswith("della"):
            params["epsilon"] = 0.1
        models = [{"model": str(a), "parameters": params}, {"model": str(b), "parameters": dict(params, weight=0.4)}]
        doc = {"merge_method": method, "models": models, "dtype": "bfloat16"}
        if method != "linear":
            doc["base_model"] = str(base)
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _assert_gpu_close(gpu: Path, cpu: Path, config: Path, method: str) -> None:
    """CLOSE_ON_GPU's bound: slerp within a bf16 rounding step of every entry; ties and breadcrumbs bit-equal at
    every entry but those where some model's |delta| ties the magnitude at a trim boundary (_tied_at_a_cut): the
    only entries two sorts may order otherwise (on an H200 the tiny models' norm weights differed at 4 and 6 of
    64 such entries)."""
    from safetensors.torch import load_file

    def tensors(out: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}

    on_gpu, on_cpu = tensors(gpu), tensors(cpu)
    assert on_gpu.keys() == on_cpu.keys()
    doc = yaml.safe_load(config.read_text())
    inputs = {m: tensors(Path(m)) for m in [doc["base_model"], *(e["model"] for e in doc["models"])]}
    for name, want in on_cpu.items():
        got = on_gpu[name]
        if method == "slerp":
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6, msg=name)
            continue
        differ = got != want
        if differ.any():
            tied = _tied_at_a_cut(inputs, doc, name)
            assert not (differ & ~tied).any(), f"{name}: {int((differ & ~tied).sum())} entries differ off the ties"


def _tied_at_a_cut(inputs: dict[str, dict[str, torch.Tensor]], doc: dict, name: str) -> torch.Tensor:
    """Entries whose |delta| in some model equals the magnitude at one of that model's cuts (ties: the top
    density * n; breadcrumbs: also the gamma * n largest dropped) where the sorted magnitudes tie across the cut.
    Taken generously: magnitudes in bf16 and in float32, each cut +-1."""
    base = inputs[doc["base_model"]][name]
    tied = torch.zeros(base.numel(), dtype=torch.bool)
    for entry in doc["models"]:
        params = entry.get("parameters", {})
        density, gamma = float(params.get("density", 1.0)), float(params.get("gamma", 0.01))
        x = inputs[entry["model"]][name]
        n = x.numel()
        in_bf16, in_f32 = (x.bfloat16() - base.bfloat16()).abs().float(), (x.float() - base.float()).abs()
        for mags in (in_bf16.flatten(), in_f32.flatten()):
            ordered = mags.sort(descending=True).values
            for cut in {int(density * n), int(gamma * n), int((gamma + density) * n)}:
                for k in (cut - 1, cut, cut + 1):
                    if 0 < k < n and ordered[k - 1] == ordered[k]:
                        tied |= mags == ordered[k]
    return tied.view(base.shape)


@pytest.mark.parametrize("method", ["ties", "breadcrumbs"])
def test_the_tie_bound_holds_for_another_sorts_order_and_catches_a_real_difference(tmp_path, tiny_models, method,
                                                                                   monkeypatch):
    """_assert_gpu_close's bound for the sorting methods, checked on the CPU: a merge whose magnitude sort breaks
    ties the other way (as a GPU's may) differs from the CPU's, and only where the bound allows; a merge with
    another weight differs elsewhere and is caught."""
    import mergesmith
    from mergesmith.kernels import magnitude_blocks, selection

    cfg = _method_config(tmp_path, tiny_models, method)
    common = dict(threads=2, random_seed=7, out_shard_size="200K")
    mergesmith.merge(str(cfg), tmp_path / "cpu", device="cpu", **common)

    def other_ties(values, lo, hi, descending=True, remake=None, zeros_free=False):  # ties broken last index first
        flipped = values.flip(0).float()
        order = flipped.size(0) - 1 - torch.sort(flipped, descending=descending, stable=True).indices
        mask = torch.zeros(values.numel(), dtype=torch.bool)
        mask[order[lo:hi]] = True
        return mask

    with monkeypatch.context() as patched:
        patched.setattr(selection, "sorted_window_mask", other_ties)
        patched.setattr(magnitude_blocks, "sorted_window_mask", other_ties)
        mergesmith.merge(str(cfg), tmp_path / "other", device="cpu", **common)
    assert _shard_bytes(tmp_path / "other") != _shard_bytes(tmp_path / "cpu")
    _assert_gpu_close(tmp_path / "other", tmp_path / "cpu", cfg, method)

    doc = yaml.safe_load(cfg.read_text())
    doc["models"][0]["parameters"]["weight"] = 0.61
    wrong = tmp_path / "wrong.yml"
    wrong.write_text(yaml.safe_dump(doc))
    mergesmith.merge(str(wrong), tmp_path / "wrong", device="cpu", **common)
    with pytest.raises(AssertionError, match="differ off the ties"):
        _assert_gpu_close(tmp_path / "wrong", tmp_path / "cpu", cfg, method)


@pytest.mark.parametrize("method", [m for m in EXACT_ON_GPU if m != "linear"])
def test_the_device_path_of_the_keyed_methods_writes_the_cpu_bytes_on_the_cpu(tmp_path, tiny_models, method,
                                                                             monkeypatch):
    """What a GPU runs for the keyed methods, run on the CPU: masks drawn by the torch Philox (not numpy's), the
    torch operations (not the compiled loops) in the device's chunks. The same bytes as the CPU path: so on a GPU
    only the device's own arithmetic could differ, which test_pipelined_cuda_merge_writes_the_cpu_bytes checks."""
    import mergesmith
    from mergesmith.kernels import keyed_merge, keyed_random

    cfg = _method_config(tmp_path, tiny_models, method)
    common = dict(threads=2, random_seed=7, out_shard_size="200K")
    mergesmith.merge(str(cfg), tmp_path / "cpu", device="cpu", **common)
    monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)
    monkeypatch.setattr(keyed_merge, "FUSED", False)
    monkeypatch.setattr(keyed_merge, "chunk_elements", lambda device: keyed_merge.DEVICE_CHUNK_ELEMENTS)
    mergesmith.merge(str(cfg), tmp_path / "device-path", device="cpu", **common)
    assert _shard_bytes(tmp_path / "device-path") == _shard_bytes(tmp_path / "cpu")


@needs_cuda
@pytest.mark.parametrize("method", GPU_METHODS)
def test_pipelined_cuda_merge_writes_the_cpu_bytes(tmp_path, tiny_models, method, monkeypatch):
    import mergesmith

    cfg = _method_config(tmp_path, tiny_models, method)
    common = dict(threads=3, random_seed=7, out_shard_size="200K")
    mergesmith.merge(str(cfg), tmp_path / "cpu", device="cpu", **common)
    mergesmith.merge(str(cfg), tmp_path / "gpu", device="cuda", **common)
    if method in EXACT_ON_GPU:
        assert _shard_bytes(tmp_path / "gpu") == _shard_bytes(tmp_path / "cpu")
    else:
        _assert_gpu_close(tmp_path / "gpu", tmp_path / "cpu", cfg, method)
    # and the old, unpipelined device path (pageable copies on the default stream) wrote them too
    monkeypatch.setattr("mergesmith.engine.execution.compute.lane_for", lambda _device: None)
    mergesmith.merge(str(cfg), tmp_path / "plain", device="cuda", **common)
    assert _shard_bytes(tmp_path / "gpu") == _shard_bytes(tmp_path / "plain")


@needs_cuda
def test_pinned_pool_is_reused_across_tensors(tmp_path, tiny_models):
    import mergesmith

    cfg = _method_config(tmp_path, tiny_models, "linear")
    lanes: list[device_transfer.DeviceLane] = []
    made = device_transfer.DeviceLane.__init__

    def recording(self, *args, **kwargs):
        made(self, *args, **kwargs)
        lanes.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_transfer.DeviceLane, "__init__", recording)
        result = mergesmith.merge(str(cfg), tmp_path / "out", device="cuda", threads=2)
    merged = len([r for r in result.plan.recipes if r.op == "merge"])
    assert lanes and merged > 10
    pinned = sum(lane.pool.pinned_calls for lane in lanes)
    # each lane pins a buffer per slot (2 inputs, 1 output) and grows it a few times, never once per tensor
    assert pinned <= len(lanes) * 3 * 4 < merged * 3


@needs_cuda
@pytest.mark.parametrize(
    "source,compute", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)]
)
def test_lane_copies_give_the_plain_copies_values(source, compute):
    torch.manual_seed(0)
    host = (torch.randn(1000, 37, dtype=torch.float64) * 1e3).to(source)
    lane = device_transfer.DeviceLane(torch.device("cuda"))
    with lane.active():
        moved = lane.to_device(host, compute, 0)
        back = lane.to_host(moved, source, lend=False)
    plain = host.to(device="cuda", dtype=compute)
    assert torch.equal(moved, plain) and moved.dtype == compute
    assert torch.equal(back, plain.to(source).cpu())


def test_executor_admits_under_the_device_budget(tmp_path, tiny_models, monkeypatch, fake_cuda):
    """The local executor on `cuda` (the arithmetic itself sent to the CPU: no GPU here) admits recipes while their
    device bytes fit --max-gpu-memory, holds the pinned staging buffers as host memory, and writes the CPU bytes."""
    import mergesmith
    from mergesmith.engine.execution import local_executor as executor
    from mergesmith.engine.planning.device_memory import device_recipe_memory, staging_bytes

    cfg = _config(tmp_path, tiny_models)
    mergesmith.merge(str(cfg), tmp_path / "cpu", threads=4)
    budgets: list[MemoryBudget] = []

    class Recording(executor.MemoryBudget):
        def __init__(self, limit: int | None) -> None:
            super().__init__(limit)
            budgets.append(self)

    real_compute = executor.compute

    def on_cpu(recipe, checkpoints, compute_dtype, explicit_dtype, device, **kw):
        assert device.type == "cuda"
        import time

        time.sleep(0.01)  # let the threads overlap
        return real_compute(recipe, checkpoints, compute_dtype, explicit_dtype, torch.device("cpu"), **kw)

    monkeypatch.setattr(executor, "MemoryBudget", Recording)
    monkeypatch.setattr(executor, "compute", on_cpu)
    plan = mergesmith.plan(str(cfg), threads=4, device="cuda").plan
    costs = sorted((device_recipe_memory(r, plan.compute_dtype) for r in plan.recipes), reverse=True)
    limit = costs[0] + costs[-1]  # the largest fits, but never beside another large one
    assert sum(costs[:4]) > limit  # four threads unbudgeted could pass it
    mergesmith.merge(str(cfg), tmp_path / "gpu", threads=4, device="cuda", max_gpu_memory=str(limit))
    device = budgets[-1].device
    assert device is not None and device.limit == limit and device.in_flight == 0
    assert costs[0] <= device.peak <= limit
    staging = staging_bytes(plan.recipes, plan.compute_dtype, device_transfer.PINNED_BYTES_PER_THREAD)
    assert staging > 0 and budgets[-1].held_bytes >= 4 * staging
    assert _shard_bytes(tmp_path / "gpu") == _shard_bytes(tmp_path / "cpu")
    # without --max-gpu-memory the budget is read from the device
    fake_cuda.clear()
    mergesmith.merge(str(cfg), tmp_path / "auto", threads=4, device="cuda")
    assert budgets[-1].device is not None and budgets[-1].device.limit == 36 * GB and fake_cuda
