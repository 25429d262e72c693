"""The command line as a user meets it: usage errors, help text, pointers to the right command,
progress off a terminal, and `plan` on awkward output paths. Each error is one `error:` line, exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from tests.helpers import assert_one_line_error, run_cli


def write_yaml(path: Path, config: Any) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


# ----- 1. usage errors -----------------------------------------------------------------------


def test_no_arguments_prints_the_help_without_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code in (0, 2)
    text = out + err
    assert "Usage: mergesmith" in text and "Commands:" in text
    assert "error:" not in text
    assert "mergesmith mergesmith" not in text


def test_unknown_command_is_one_line_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, "mrege")
    line = assert_one_line_error(code, err, "mrege", "merge")
    assert "mergesmith mergesmith" not in line
    assert "`mergesmith --help`" in line


def test_usage_error_in_a_subcommand_points_to_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, "merge")
    line = assert_one_line_error(code, err, "CONFIG_FILE")
    assert "`mergesmith merge --help`" in line


# ----- 2. `plan` on awkward output paths --------------------------------------------------------


@pytest.fixture
def linear_cfg(tmp_path: Path, tiny_models: Any) -> Path:
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    return write_yaml(
        tmp_path / "c.yml",
        {"merge_method": "linear", "models": [{"model": str(a)}, {"model": str(b)}], "parameters": {"weight": 0.5}},
    )


def _plan_json(capsys: pytest.CaptureFixture[str], cfg: Path, out: Path) -> dict[str, Any]:
    import json

    code, stdout, err = run_cli(capsys, "plan", cfg, out, "--json")
    assert code == 0, err
    return json.loads(stdout)


def _plan_text(capsys: pytest.CaptureFixture[str], cfg: Path, out: Path) -> str:
    code, stdout, err = run_cli(capsys, "plan", cfg, out)
    assert code == 0, err
    return stdout


def test_plan_out_dir_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path
) -> None:
    out = tmp_path / "taken"
    out.write_text("not a directory")
    assert_one_line_error(*run_cli(capsys, "plan", linear_cfg, out)[::2], str(out))
    assert_one_line_error(*run_cli(capsys, "plan", linear_cfg, out / "sub")[::2], str(out))


def test_plan_skips_the_write_probe_when_the_disk_is_nearly_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    real = shutil.disk_usage

    def nearly_full(path: Any) -> Any:
        usage = real(path)
        return type(usage)(usage.total, usage.total - 10_000_000, 10_000_000)

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    report = _plan_json(capsys, linear_cfg, tmp_path / "out")
    assert report["write_throughput_bytes_per_s"] is None and report["write_not_measured"]
    assert report["read_throughput_bytes_per_s"] > 0
    text = _plan_text(capsys, linear_cfg, tmp_path / "out")
    assert "write speed not measured" in text
    assert not list(tmp_path.glob(".mergesmith-probe-*"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_plan_write_probe_hitting_enospc_is_reported_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe file lands on a full filesystem (/dev/full answers every write with ENOSPC)."""
    import os
    import tempfile

    def full_disk(*args: Any, **kwargs: Any) -> tuple[int, str]:
        name = tmp_path / ".mergesmith-probe-x"
        name.write_bytes(b"")
        return os.open("/dev/full", os.O_WRONLY), str(name)

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    report = _plan_json(capsys, linear_cfg, tmp_path / "out")
    assert report["write_throughput_bytes_per_s"] is None
    assert "space" in report["write_not_measured"]
    text = _plan_text(capsys, linear_cfg, tmp_path / "out")
    assert "write speed not measured" in text and "no space" in text
    assert not (tmp_path / ".mergesmith-probe-x").exists()


def test_plan_on_a_read_only_output_says_not_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import tempfile

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    text = _plan_text(capsys, linear_cfg, tmp_path / "out")
    disk = next(line for line in text.splitlines() if line.startswith("disk at"))
    assert "not writable" in disk and "(ok)" not in disk
    report = _plan_json(capsys, linear_cfg, tmp_path / "out")
    assert report["disk"]["writable"] is False and report["write_throughput_bytes_per_s"] is None


def test_plan_without_out_dir_does_not_label_the_read_speed_as_write_speed(
    capsys: pytest.CaptureFixture[str], linear_cfg: Path
) -> None:
    code, stdout, err = run_cli(capsys, "plan", linear_cfg)
    assert code == 0, err
    probe = next(line for line in stdout.splitlines() if line.startswith("throughput probe"))
    assert "write speed not measured" in probe


# ----- 4. `plan --tensors` shows each tensor's parameters ----------------------------------------


def test_plan_tensors_text_lists_each_tensors_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_models: Any
) -> None:
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    cfg = write_yaml(
        tmp_path / "c.yml",
        {
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 1.0}},
                {"model": str(b), "parameters": {"weight": [0.0, 1.0]}},
            ],
            "parameters": {"normalize": False},
        },
    )
    code, out, err = run_cli(capsys, "plan", cfg, "--tensors")
    assert code == 0, err
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines() if " <- " in line}
    first, last = lines["model.layers.0.mlp.up_proj.weight"], lines["model.layers.3.mlp.up_proj.weight"]
    assert "linear" in first.split(" <- ")[1] and "normalize=false" in first
    assert "weight=[1, 0]" in first and "weight=[1, 1]" in last


# ----- 5. progress off a terminal -------------------------------------------------------------


def test_merge_off_a_terminal_prints_plain_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under capsys stderr is not a terminal, as in a pipe or a notebook's `!mergesmith`."""
    import re

    monkeypatch.setenv("MERGESMITH_TEST_SLOW", "0.05")  # seconds per tensor: 39 tensors last ~2 s
    monkeypatch.setenv("MERGESMITH_PROGRESS_INTERVAL", "0.3")
    code, out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "out", "--threads", "1")
    assert code == 0, err
    assert "wrote" in out
    lines = err.strip().splitlines()
    pattern = re.compile(r"^progress: \d+/39 tensors, [\d.]+ MB/s, RSS [\d.]+ GB, ETA (\d+:\d\d:\d\d|unknown)$")
    assert len(lines) >= 2 and all(pattern.match(line) for line in lines), err
    assert "\x1b[" not in err  # plain text, no terminal control codes

    code, out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "quiet", "--threads", "1", "-q")
    assert code == 0 and err == "", err


# ----- 6. errors that point to the right command or say what is wrong ---------------------------

_TWO_DOCS = "merge_method: linear\nmodels:\n  - model: a\n---\nmerge_method: linear\nmodels:\n  - model: b\n"
_MOE = {"base_model": "a", "gate_mode": "random", "experts": [{"source_model": "a"}, {"source_model": "b"}]}


@pytest.mark.parametrize("command", ["merge", "plan"])
def test_multi_document_yaml_points_to_multi(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    cfg = tmp_path / "stages.yml"
    cfg.write_text(_TWO_DOCS)
    assert_one_line_error(*run_cli(capsys, command, cfg, tmp_path / "out")[::2], str(cfg), "mergesmith multi")


@pytest.mark.parametrize(
    "args",
    [["multi", "{cfg}", "--out-dir", "{out}"], ["merge-raw", "{cfg}", "{out}"]],
    ids=["multi", "merge-raw"],
)
def test_moe_config_given_to_multi_or_merge_raw_points_to_moe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    cfg = write_yaml(tmp_path / "moe.yml", _MOE)
    argv = [a.format(cfg=cfg, out=tmp_path / "out") for a in args]
    assert_one_line_error(*run_cli(capsys, *argv)[::2], str(cfg), "mergesmith moe")
    assert not (tmp_path / "out").exists()


def test_moe_document_in_a_multi_stage_file_points_to_moe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "stages.yml"
    cfg.write_text(_TWO_DOCS.split("---")[0] + "---\n" + yaml.safe_dump(_MOE))
    line = assert_one_line_error(*run_cli(capsys, "multi", cfg, "--out-dir", tmp_path / "out")[::2], "mergesmith moe")
    assert "document 2" in line


@pytest.mark.parametrize("command", ["merge", "plan", "multi", "merge-raw", "moe"])
def test_empty_config_file_says_it_is_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text("# nothing yet\n")
    out = ["--out-dir", tmp_path / "out"] if command == "multi" else [tmp_path / "out"]
    assert_one_line_error(*run_cli(capsys, command, cfg, *out)[::2], f"{cfg}: the config file is empty")


def test_models_as_plain_strings_says_how_to_write_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_yaml(tmp_path / "c.yml", {"merge_method": "linear", "models": ["org/model-a", "org/model-b"]})
    assert_one_line_error(*run_cli(capsys, "plan", cfg)[::2], "models[0]", "- model: org/model-a")


@pytest.mark.parametrize("command", ["merge", "plan", "multi", "merge-raw", "moe"])
def test_config_path_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    out = ["--out-dir", tmp_path / "out"] if command == "multi" else [tmp_path / "out"]
    assert_one_line_error(*run_cli(capsys, command, cfg, *out)[::2], str(cfg), "is a directory")


# ----- 7. --ray-address and --device with the Ray executor ------------------------------------


@pytest.mark.parametrize("command", ["plan", "merge"])
def test_ray_address_without_the_ray_executor_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, command: str
) -> None:
    out = tmp_path / "out"
    assert_one_line_error(*run_cli(capsys, command, linear_cfg, out, "--ray-address", "auto")[::2], "--executor ray")
    assert not out.exists()


def test_device_cuda_with_the_ray_executor_is_not_checked_on_the_driver(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linear_cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU-only head node plans for GPU workers; a local merge on a CPU-only machine is refused."""
    pytest.importorskip("ray")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(*run_cli(capsys, "plan", linear_cfg, "--device", "cuda")[::2], "--device cuda")
    code, out, err = run_cli(capsys, "plan", linear_cfg, "--device", "cuda", "--executor", "ray", "--json")
    assert code == 0, err


# ----- 8. help text ---------------------------------------------------------------------------


def test_top_level_help_shows_every_command_description_whole(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "--help")
    assert code == 0, err
    commands = out.split("Commands:", 1)[1].strip().splitlines()
    names = {line.split()[0] for line in commands}
    assert names == {"merge", "plan", "merge-raw", "multi", "moe", "extract-lora", "evolve", "tokensurgeon"}
    for line in commands:
        assert len(line.split(None, 1)) == 2, f"no description: {line!r}"
        assert not line.rstrip().endswith("..."), f"truncated: {line!r}"


def test_merge_raw_help_hides_options_with_no_effect_there(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = run_cli(capsys, "merge-raw", "--help")
    assert code == 0
    options, epilog = out.split("Also accepted from mergekit-pytorch", 1)  # named there: each prints a note
    for hidden in ("--copy-tokenizer", "--write-model-card", "--trust-remote-code"):
        assert hidden not in options and hidden in " ".join(epilog.split()).replace("- ", "-")
    assert "--tensor-union" in out and "--out-shard-size" in out
    code, out, _err = run_cli(capsys, "merge", "--help")
    for shown in ("--copy-tokenizer", "--write-model-card", "--trust-remote-code"):
        assert shown in out


def test_every_option_of_every_command_has_help_text() -> None:
    from mergesmith.cli import cli

    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"`mergesmith {name}` option {param.opts[0]} has no help text"


# ----- 9. OUT_DIR inside an input model's directory ---------------------------------------------


@pytest.mark.parametrize("exists", [False, True])
def test_out_dir_inside_an_input_model_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_models: Any, exists: bool
) -> None:
    import shutil

    mine = tmp_path / "models" / "tiny-llama-0"
    shutil.copytree(tiny_models("llama", seed=1), mine)
    other = tiny_models("llama", seed=2)
    cfg = write_yaml(
        tmp_path / "c.yml",
        {
            "merge_method": "linear",
            "models": [{"model": str(mine)}, {"model": str(other)}],
            "parameters": {"weight": 0.5},
        },
    )
    out = mine / "sub" / "merged"
    if exists:
        out.mkdir(parents=True)
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    line = assert_one_line_error(*run_cli(capsys, "merge", cfg, out)[::2], str(out), "inside", str(mine))
    assert "input model" in line
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before


# ----- 10. config validation errors through the CLI ---------------------------------------------

_TWO_SLICES = [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 3]}]
_INVALID_CONFIGS = {
    "unknown-method": ({"merge_method": "lineer", "models": [{"model": "a"}]}, ["merge_method", "linear"]),
    "models-and-slices": (
        {
            "merge_method": "linear",
            "models": [{"model": "a"}],
            "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}]}],
        },
        ["`models` or `slices`, not both"],
    ),
    "missing-base-model": (
        {"merge_method": "ties", "models": [{"model": "a"}, {"model": "b"}]},
        ["base_model", "requires a base model"],
    ),
    "unequal-layer-ranges": (
        {"merge_method": "linear", "slices": [{"sources": _TWO_SLICES}]},
        ["layer_range", "different numbers of layers"],
    ),
}


@pytest.mark.parametrize("command", ["merge", "plan"])
@pytest.mark.parametrize("case", sorted(_INVALID_CONFIGS))
def test_config_validation_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, command: str
) -> None:
    config, names = _INVALID_CONFIGS[case]
    cfg = write_yaml(tmp_path / "c.yml", config)
    out = tmp_path / "out"
    assert_one_line_error(*run_cli(capsys, command, cfg, out)[::2], str(cfg), *names)
    assert not out.exists()
