"""The documentation site builds with ``mkdocs build --strict``: no broken link, anchor, include or
API reference (mkdocs.yml, docs/, and the hook docs/_hooks/repo_files.py that includes and links the
repository's own files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "_hooks" / "repo_files.py"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` (any warning fails it), quiet about the theme's own notice."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
               "-d", str(site)]
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(command, capture_output=True, text=True, timeout=90, env=env)


def test_the_site_builds_strict_without_a_warning(tmp_path):
    out = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0 and "WARNING" not in out.stderr, out.stderr
    site = tmp_path / "site"
    # The included files are shown, and a linked repository file is in the site.
    assert "How a notice flows" in (site / "architecture" / "index.html").read_text()
    assert "Detection after a fault" in (site / "benchmarks" / "index.html").read_text()
    assert (site / "_source" / "examples" / "train_plain.py").read_bytes() == \
        (ROOT / "examples" / "train_plain.py").read_bytes()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="spotguard.run.Run"' in api and ":class:" not in api  # Sphinx roles shown as code


def site_linking(tmp_path: Path, target: str) -> Path:
    """A one-page site in ``tmp_path`` (its repository root) whose page links to ``target``."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "job.py").write_text("print('hi')\n")
    (tmp_path / "NOTES.md").write_text("# Notes\n\nSee [the job](job.py).\n")
    page = f'# Home\n\nRun [it]({target}).\n\n--8<-- "NOTES.md" +1\n'
    (tmp_path / "docs" / "index.md").write_text(page)
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: docs\nhooks: [{HOOK}]\n")
    return config


def test_a_link_to_a_repository_file_is_copied_into_the_site(tmp_path):
    out = build(site_linking(tmp_path, "../job.py"), tmp_path / "site")
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "site" / "index.html").read_text()
    assert 'href="_source/job.py"' in page and "<h2" in page  # the include's heading is demoted
    assert (tmp_path / "site" / "_source" / "job.py").read_text() == "print('hi')\n"


def test_a_link_to_a_missing_repository_file_fails_the_strict_build(tmp_path):
    out = build(site_linking(tmp_path, "../gone.py"), tmp_path / "site")
    assert out.returncode != 0
    assert "index.md links to ../gone.py, which is not in the repository" in out.stderr
