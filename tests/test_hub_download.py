"""Hub ids are downloaded when not in the cache (issue 29, item 3).

No network here: tests/hub_server.py stands in for the Hugging Face Hub on 127.0.0.1, and HF_ENDPOINT points
the client at it. The client under test is the real `huggingface_hub`, in a subprocess whose environment
drops the suite's HF_HUB_OFFLINE=1 (huggingface_hub reads its settings when it is imported) and whose cache
(HF_HOME, HF_HUB_CACHE) is in tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import read_state_dict, write_config
from tests.hub_server import HubServer, Repo, files_of

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def _env(server: HubServer, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    for name in PROXY_VARIABLES:
        env.pop(name, None)
    env.update(
        HF_ENDPOINT=server.endpoint,
        HF_HOME=str(home),
        HF_HUB_CACHE=str(home / "hub"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _mergesmith(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def _one_error_line(run: subprocess.CompletedProcess[str], *names: str) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, Path]:
    """Three tiny llamas: `a` (one safetensors file), `b` (sharded, with an index) and `c` (what `b`'s main
    branch holds, while the config asks for `b`'s revision v1)."""
    a = tiny_models("llama", seed=11)
    return {
        "a": a,
        "b": tiny_models.derive(a, seed=12, scale=0.05, fmt="sharded"),
        "c": tiny_models.derive(a, seed=13, scale=0.05),
    }


@pytest.fixture
def hub(models: dict[str, Path]):
    with HubServer() as server:
        a = Repo()
        # a .bin beside the safetensors, and an export in a subfolder: neither is needed by a merge
        a.add_commit(
            files_of(models["a"], **{"pytorch_model.bin": b"\x80unused", "onnx__model.onnx": b"x" * 64}), "main"
        )
        b = Repo()
        b.add_commit(files_of(models["c"]), "main")
        b.add_commit(files_of(models["b"]), "v1")
        server.repos.update({"org/tiny-a": a, "org/tiny-b": b, "org/gated": Repo(gated=True)})
        yield server


def _config(tmp_path: Path, first: str, second: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_config(
        tmp_path / "linear.yml",
        {
            "merge_method": "linear",
            "models": [{"model": first, "parameters": {"weight": 0.6}}, {**second, "parameters": {"weight": 0.4}}],
            "dtype": "float32",
        },
    )


def test_hub_models_are_downloaded_and_merged(tmp_path: Path, hub: HubServer, models: dict[str, Path]) -> None:
    env = _env(hub, tmp_path / "hf")
    config = _config(tmp_path, "org/tiny-a", {"model": "org/tiny-b", "revision": "v1"})

    plan = _mergesmith(env, "plan", config, tmp_path / "out", "--json")
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert len(report["tensors"]) == len(read_state_dict(models["a"]))  # the whole plan, before any weight is fetched
    downloads = report["downloads"]
    per_model = {d["model"]: d for d in downloads["models"]}
    assert set(per_model) == {"org/tiny-a", "org/tiny-b@v1"}
    a_weights = (models["a"] / "model.safetensors").stat().st_size
    assert per_model["org/tiny-a"]["files"] == [{"name": "model.safetensors", "bytes": a_weights}]
    assert len(per_model["org/tiny-b@v1"]["files"]) == len(list(models["b"].glob("*.safetensors"))) > 1
    assert downloads["download_bytes"] == sum(d["bytes"] for d in downloads["models"]) > a_weights
    assert downloads["output_bytes"] == report["bytes_written"] and downloads["output_planned"]
    cache_disk = downloads["disk"][0]  # the cache and OUT_DIR share tmp_path's filesystem: counted together
    assert cache_disk["needed_bytes"] == downloads["download_bytes"] + report["bytes_written"] and cache_disk["enough"]
    weights_fetched = [p for m, p, r in hub.log if m == "GET" and p.endswith(".safetensors") and r is None]
    assert weights_fetched == [], weights_fetched  # headers came from Range requests, no weight file was fetched
    ranged = [(p, r) for m, p, r in hub.log if m == "GET" and r]
    assert ranged and all(r.startswith("bytes=0-") for _, r in ranged), ranged
    text = _mergesmith(env, "plan", config)
    assert text.returncode == 0, text.stderr
    shards = len(list(models["b"].glob("*.safetensors")))
    assert "to download from the Hugging Face Hub" in text.stdout and f"org/tiny-b@v1: {shards} file(s)" in text.stdout
    hub.log.clear()

    merged = _mergesmith(env, "merge", config, tmp_path / "out")
    assert merged.returncode == 0, merged.stderr
    assert "downloading org/tiny-a from the Hugging Face Hub" in merged.stderr
    fetched = hub.requested("GET")
    assert not [p for p in fetched if p.endswith((".bin", ".onnx"))], fetched  # one weight format, top level only
    assert any("/tiny-b/resolve/v1/" in p and p.endswith(".safetensors") for p in fetched), fetched
    assert not any("/tiny-b/resolve/main/" in p for p in fetched), fetched  # the revision asked for, not main

    # the same merge from the local directories gives the same bytes: `revision: v1` was honoured
    local = _config(tmp_path / "local", str(models["a"]), {"model": str(models["b"])})
    ref = _mergesmith(env, "merge", local, tmp_path / "local-out", "--offline")
    assert ref.returncode == 0, ref.stderr
    out, expected = read_state_dict(tmp_path / "out"), read_state_dict(tmp_path / "local-out")
    assert out.keys() == expected.keys() and all(torch.equal(out[n], expected[n]) for n in out)

    # a rerun (another output) asks the Hub nothing: both models are complete in the cache
    before = len(hub.log)
    again = _mergesmith(env, "merge", config, tmp_path / "out2")
    assert again.returncode == 0, again.stderr
    assert len(hub.log) == before and "downloading" not in again.stderr
    replan = _mergesmith(env, "plan", config, "--json")
    assert replan.returncode == 0 and "downloads" not in json.loads(replan.stdout), replan.stdout
    assert len(hub.log) == before  # nor does plan


def test_plan_of_bin_weights_lists_the_downloads(tmp_path: Path, hub: HubServer, tiny_models) -> None:
    """`.bin` weights have no header to read over HTTP: plan lists the downloads and the disk they need, with
    the output estimated, and says so; the merge then downloads the `.bin` and merges it."""
    as_bin = tiny_models("llama", seed=11, fmt="bin")
    repo = Repo()
    repo.add_commit(files_of(as_bin), "main")
    hub.repos["org/tiny-bin"] = repo
    env = _env(hub, tmp_path / "hf")
    config = _config(tmp_path, "org/tiny-bin", {"model": "org/tiny-a"})
    plan = _mergesmith(env, "plan", config, tmp_path / "out", "--json")
    assert plan.returncode == 0, plan.stderr
    downloads = json.loads(plan.stdout)["downloads"]
    assert {d["model"] for d in downloads["models"]} == {"org/tiny-bin", "org/tiny-a"}
    assert not downloads["output_planned"] and downloads["output_bytes"] > 0
    text = _mergesmith(env, "plan", config, tmp_path / "out")
    assert "output estimated as the largest model's weights" in text.stdout, text.stdout
    merged = _mergesmith(env, "merge", config, tmp_path / "out", "-q")
    assert merged.returncode == 0, merged.stderr
    assert any(p.endswith("/tiny-bin/resolve/main/pytorch_model.bin") for p in hub.requested("GET"))


def test_transformers_cache_is_where_models_go(tmp_path: Path, hub: HubServer) -> None:
    env = _env(hub, tmp_path / "hf")
    config = _config(tmp_path, "org/tiny-a", {"model": "org/tiny-b", "revision": "v1"})
    cache = tmp_path / "elsewhere"
    run = _mergesmith(env, "merge", config, tmp_path / "out", "--transformers-cache", cache, "-q")
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # -q: no download lines either
    assert (cache / "models--org--tiny-a").is_dir() and not (tmp_path / "hf" / "hub" / "models--org--tiny-a").exists()
    # found there again without the Hub, offline
    offline = _mergesmith(env, "merge", config, tmp_path / "out2", "--transformers-cache", cache, "--offline", "-q")
    assert offline.returncode == 0, offline.stderr


def test_offline_refuses_a_missing_model_in_one_line(tmp_path: Path, hub: HubServer) -> None:
    config = _config(tmp_path, "org/tiny-a", {"model": "org/tiny-b", "revision": "v1"})
    for extra, env in (
        (("--offline",), _env(hub, tmp_path / "hf")),
        ((), _env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")),
    ):
        for command in ("merge", "plan"):
            run = _mergesmith(env, command, config, tmp_path / "out", *extra)
            line = _one_error_line(run, "'org/tiny-a'", "not in the local Hugging Face cache", "hf download org/tiny-a")
            assert ("--offline" in line) == bool(extra)
    assert hub.log == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("org/no-such-model", "not a model on the Hugging Face Hub"),
        ("org/gated", "gated"),
        ("org/tiny-a@no-such-branch", "no revision 'no-such-branch'"),
    ],
)
def test_a_model_the_hub_does_not_give_is_one_line(tmp_path: Path, hub: HubServer, model: str, words: str) -> None:
    env = _env(hub, tmp_path / "hf")
    config = _config(tmp_path, model, {"model": "org/tiny-a"})
    for command in ("merge", "plan"):
        _one_error_line(_mergesmith(env, command, config, tmp_path / "out"), repr(model), words)
    assert not (tmp_path / "out").exists()


def test_unreachable_hub_is_one_line(tmp_path: Path, hub: HubServer) -> None:
    env = _env(hub, tmp_path / "hf", HF_ENDPOINT="http://127.0.0.1:9")  # the discard port: nothing listens
    config = _config(tmp_path, "org/tiny-a", {"model": "org/tiny-b"})
    for command in ("plan", "merge"):
        _one_error_line(_mergesmith(env, command, config, tmp_path / "out"), "'org/tiny-a'", "cannot be reached")
    assert not (tmp_path / "out").exists()


def test_a_dropped_download_resumes(tmp_path: Path, hub: HubServer, tiny_models) -> None:
    """The connection drops near the end of the weights: huggingface_hub asks for the rest (a Range request from
    the last whole 10 MB chunk it wrote, hence a model a little over 10 MB) and the merge reads the whole file."""
    big = tiny_models("llama", seed=21, layers=2, hidden_size=384, intermediate_size=768)
    weights = (big / "model.safetensors").read_bytes()
    assert len(weights) > (10 << 20) + 4096
    repo = Repo()
    repo.add_commit(files_of(big), "main")
    hub.repos["org/big"] = repo
    hub.cut_once["org/big/model.safetensors"] = len(weights) - 4096
    env = _env(hub, tmp_path / "hf")
    config = write_config(tmp_path / "one.yml", {"merge_method": "passthrough", "models": [{"model": "org/big"}]})
    run = _mergesmith(env, "merge", config, tmp_path / "out", "-q")
    assert run.returncode == 0, run.stderr
    gets = [r for m, p, r in hub.log if m == "GET" and p == "/org/big/resolve/main/model.safetensors"]
    assert gets == [None, f"bytes={10 << 20}-"], gets  # the first whole chunk was kept, the rest asked for
    snapshot = next((tmp_path / "hf" / "hub" / "models--org--big" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == weights


def test_not_enough_space_for_the_downloads(tmp_path: Path, hub: HubServer, monkeypatch) -> None:
    """The cache's filesystem is checked before any weight is fetched (here: told it has 1 KB free)."""
    from mergesmith.engine.downloads import check_download_space
    from mergesmith.errors import OutputError
    from mergesmith.io import hub as hub_io

    download = hub_io.Download("org/x", None, [("model.safetensors", 10_000_000)], 10_000_000)
    monkeypatch.setattr(hub_io, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(hub_io.shutil, "disk_usage", lambda _p: type("U", (), {"free": 1000})())
    with pytest.raises(OutputError, match="downloads 10.0 MB \\+ output about 10.0 MB need 20.0 MB"):
        check_download_space([download], tmp_path / "out", force=False)
    check_download_space([download], tmp_path / "out", force=True)


def test_choose_files_prefers_one_safetensors_format() -> None:
    from mergesmith.io.hub import choose_files

    shards = {"model.safetensors.index.json": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]}
    repo = {
        "config.json": 1, "generation_config.json": 1, "tokenizer.json": 1, "README.md": 1,
        "model.safetensors.index.json": 1, "model-00001-of-00002.safetensors": 1, "model-00002-of-00002.safetensors": 1,
        "consolidated.safetensors": 1, "pytorch_model.bin": 1, "onnx/model.onnx": 1,
    }  # fmt: skip
    small, weights = choose_files(repo, shards.__getitem__)
    assert small == ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"]
    assert weights == shards["model.safetensors.index.json"]
    assert choose_files({"config.json": 1, "pytorch_model.bin": 1}, shards.__getitem__)[1] == ["pytorch_model.bin"]
    both = {"model.safetensors": 1, "pytorch_model.bin": 1}
    assert choose_files(both, shards.__getitem__)[1] == ["model.safetensors"]
    adapter = {"adapter_config.json": 1, "adapter_model.safetensors": 1, "adapter_model.bin": 1, "README.md": 1}
    assert choose_files(adapter, shards.__getitem__) == (["adapter_config.json"], ["adapter_model.safetensors"])


def test_download_bars_at_a_terminal(tmp_path: Path, hub: HubServer) -> None:
    """At a terminal (a pseudo-terminal here) the downloads show huggingface_hub's own bars, one per file
    (extract-lora: a command that reads hub models and draws no bar of its own)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    env = _env(hub, tmp_path / "hf", COLUMNS="100", TERM="xterm")
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # 40 rows, 100 columns
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mergesmith.cli", "extract-lora", "--model", "org/tiny-b@v1", "--base", "org/tiny-a",
         "--out", str(tmp_path / "lora"), "--max-rank", "4"],
        stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True,
    )  # fmt: skip
    os.close(secondary)
    code = proc.wait(timeout=300)
    reader.join(timeout=30)
    os.close(primary)
    text = screen.decode(errors="replace")
    assert code == 0, text
    assert "downloading org/tiny-a from the Hugging Face Hub" in text
    assert "model.safetensors: 100%" in text, text  # tqdm's bar for the file, finished
    assert "  org/tiny-a: model.safetensors (" not in text  # the per-file lines are for logs, not terminals
    assert "wrote " in text


def test_every_model_reading_command_downloads(tmp_path: Path, hub: HubServer) -> None:
    """moe, tokensurgeon, multi and merge-raw reach the same resolver: each, with its own empty cache, downloads
    the hub models it names (merge: above; extract-lora: the terminal test)."""
    import yaml

    two = [
        {"model": "org/tiny-a", "parameters": {"weight": 1}},
        {"model": "org/tiny-b@v1", "parameters": {"weight": 1}},
    ]
    (tmp_path / "moe.yml").write_text(
        yaml.safe_dump(
            {
                "base_model": "org/tiny-a",
                "gate_mode": "random",
                "dtype": "float32",
                "experts": [{"source_model": "org/tiny-a"}, {"source_model": "org/tiny-b@v1"}],
            }
        )
    )
    final = {"merge_method": "linear", "models": [{"model": "mid", "parameters": {"weight": 1}}, two[0]]}
    multi = yaml.safe_dump({"name": "mid", "merge_method": "linear", "models": two}) + "---\n" + yaml.safe_dump(final)
    (tmp_path / "multi.yml").write_text(multi)
    (tmp_path / "raw.yml").write_text(yaml.safe_dump({"merge_method": "linear", "models": two}))
    commands = {
        "moe": ("moe", tmp_path / "moe.yml", tmp_path / "moe-out"),
        "tokensurgeon": ("tokensurgeon", "org/tiny-a", "org/tiny-b@v1", tmp_path / "ts-out"),
        "multi": ("multi", tmp_path / "multi.yml", "--out-dir", tmp_path / "stages", "--out-path", tmp_path / "final"),
        "merge-raw": ("merge-raw", tmp_path / "raw.yml", tmp_path / "raw-out"),
    }
    for name, args in commands.items():
        home = tmp_path / f"hf-{name}"
        run = _mergesmith(_env(hub, home), *args, "-q")
        assert run.returncode == 0, f"{name}: {run.stderr}"
        for repo in ("models--org--tiny-a", "models--org--tiny-b"):
            assert (home / "hub" / repo / "snapshots").is_dir(), f"{name} did not download {repo}"


API_SCRIPT = """
import sys, mergesmith
config, out, cache = sys.argv[1:]
report = mergesmith.plan(config, transformers_cache=cache)
assert report.plan is not None and report.report["downloads"]["download_bytes"] > 0, report.report
assert "to download from the Hugging Face Hub" in report.text
mergesmith.merge(config, out, transformers_cache=cache, progress=True)
assert "downloads" not in mergesmith.plan(config, transformers_cache=cache).report
try:
    mergesmith.plan(config, offline=True)  # the default cache is empty
except mergesmith.CheckpointError as exc:
    print("refused:", exc)
"""


def test_python_api_downloads(tmp_path: Path, hub: HubServer) -> None:
    """The API takes the same `transformers_cache` and `offline`; `plan` lists the downloads beside the plan, and
    `merge(progress=True)` says what it downloads."""
    config = _config(tmp_path, "org/tiny-a", {"model": "org/tiny-b", "revision": "v1"})
    cache = tmp_path / "api-cache"
    run = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, str(config), str(tmp_path / "out"), str(cache)],
        capture_output=True, text=True, env=_env(hub, tmp_path / "hf"), timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "downloading org/tiny-a from the Hugging Face Hub" in run.stderr
    assert "refused: model 'org/tiny-a': not a local path and not in the local Hugging Face cache" in run.stdout
    assert (cache / "models--org--tiny-b").is_dir()


def test_model_plus_lora_from_the_hub(tmp_path: Path, hub: HubServer, models: dict[str, Path]) -> None:
    """`org/model+org/adapter`: both parts are downloaded (the adapter's config and weights) and the merge equals
    the same reference made of the local directories."""
    adapter = tmp_path / "adapter"
    made = _mergesmith(
        _env(hub, tmp_path / "hf"), "extract-lora", "--model", models["c"], "--base", models["a"], "--out", adapter,
        "--max-rank", "4", "--offline",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    repo = Repo()
    repo.add_commit(files_of(adapter), "main")
    hub.repos["org/tiny-lora"] = repo
    env = _env(hub, tmp_path / "hf")
    for name, ref in (("hub", "org/tiny-a+org/tiny-lora"), ("local", f"{models['a']}+{adapter}")):
        config = write_config(tmp_path / f"{name}.yml", {"merge_method": "passthrough", "models": [{"model": ref}]})
        plan = _mergesmith(env, "plan", config, "--json")  # before the download, from headers
        assert plan.returncode == 0 and json.loads(plan.stdout)["tensors"], f"{name}: {plan.stderr}"
        run = _mergesmith(env, "merge", config, tmp_path / f"{name}-out", "-q")
        assert run.returncode == 0, f"{name}: {run.stderr}"
    out, expected = read_state_dict(tmp_path / "hub-out"), read_state_dict(tmp_path / "local-out")
    assert out.keys() == expected.keys() and all(torch.equal(out[n], expected[n]) for n in out)
    assert any(p.endswith("/tiny-lora/resolve/main/adapter_config.json") for p in hub.requested("GET"))


def test_a_tokenizer_source_is_fetched_without_its_weights(tmp_path: Path, hub: HubServer, models: dict) -> None:
    """`tokenizer_source: org/model` needs that model's tokenizer, not its weights."""
    repo = Repo()
    repo.add_commit(files_of(models["c"]), "main")
    hub.repos["org/tiny-c"] = repo
    config = write_config(
        tmp_path / "tok.yml",
        {
            "merge_method": "linear",
            "models": [
                {"model": "org/tiny-a", "parameters": {"weight": 1}},
                {"model": "org/tiny-b@v1", "parameters": {"weight": 1}},
            ],
            "tokenizer_source": "org/tiny-c",
        },
    )
    run = _mergesmith(_env(hub, tmp_path / "hf"), "merge", config, tmp_path / "out", "-q")
    assert run.returncode == 0, run.stderr
    from_c = [p for p in hub.requested("GET") if "/tiny-c/resolve/" in p]
    assert any(p.endswith("/tokenizer.json") for p in from_c), from_c
    assert not any(p.endswith(".safetensors") for p in from_c), from_c
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (models["c"] / "tokenizer.json").read_bytes()
