"""The README's "A first merge" runs as written, and its links to sections land on a heading.

The block is run line by line with bash, the way a newcomer pastes it, in a copy of `examples/` (the
block names paths relative to the checkout), with the venv's `mergesmith` first on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def bash_block(text: str) -> str:
    match = re.search(r"```bash\n(.*?)```", text, re.S)
    assert match, "no bash block"
    return match.group(1)


def test_first_merge_block_runs_as_written(tmp_path: Path) -> None:
    block = bash_block(section(README.read_text(), "A first merge"))
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) <= 5, "the README promises a first merge in five lines"
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("models"))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "first-merge" / "config.json").is_file()
    assert "LlamaForCausalLM" in done.stdout
    listed = set(done.stdout.split())
    for name in ("config.json", "model.safetensors", "README.md", "mergekit_config.yml"):
        assert name in listed, f"`ls first-merge` did not show {name}: {done.stdout}"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def test_readme_section_links_land_on_headings() -> None:
    text = README.read_text()
    text_outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = {github_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", text_outside_code)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "the README's command table links to its sections"
    missing = sorted(set(links) - anchors)
    assert not missing, f"links to no heading: {missing}"


def test_every_subcommand_is_in_the_readme_command_table() -> None:
    from mergesmith.cli import cli

    table = section(README.read_text(), "Commands")
    names = set(re.findall(r"`mergesmith ([a-z-]+)", table))
    commands = set(cli.list_commands(None))  # type: ignore[arg-type]
    assert commands <= names, f"commands missing from the README's table: {sorted(commands - names)}"
