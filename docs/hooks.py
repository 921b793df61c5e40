"""MkDocs hook: the site also serves BENCHMARKS.md and the plots it links to, from the repository root.

BENCHMARKS.md stays where it is (the benchmarks append to it); the docs link to it as `BENCHMARKS.md` at the
site's root, and its own links (`benchmarks/results/*.png`) resolve there too.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    extra = [ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "results").glob("*.png"))]
    for path in extra:
        files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    return files
