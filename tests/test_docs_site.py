"""The docs site (``make docs``): MkDocs with the Material theme over ``docs/``, built with
``--strict`` as the Makefile builds it, so a broken link or anchor, or a page left out of the
nav, fails the suite; and a copy of ``docs/`` with one broken link is refused, so the check is
real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build(docs: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(docs / "site" / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )


def test_the_site_builds_strictly_with_every_page_and_picture(tmp_path):
    done = _build(ROOT / "docs", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        built = tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.is_file(), page
    pictures = [*sorted(p.name for p in (ROOT / "docs").glob("*.png")), "pipeline.svg"]
    assert all((tmp_path / "site" / name).is_file() for name in pictures)
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert 'src="../quality-compressed.png"' in benchmarks


def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "orphan.md").write_text("# Not in the nav\n")
    done = _build(docs, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr
    (docs / "orphan.md").unlink()
    guide = docs / "guide.md"
    guide.write_text(guide.read_text(encoding="utf-8") + "\nSee [nowhere](nowhere.md).\n")
    done = _build(docs, tmp_path / "site")
    assert done.returncode != 0 and "nowhere.md" in done.stderr
