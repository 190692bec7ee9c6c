"""The documentation site builds with ``mkdocs build --strict``: no broken link, anchor, include or
API reference (mkdocs.yml, docs/, and the hook docs/_hooks/repo_files.py that includes and links the
repository's own files)."""

from __future__ import annotations

import re
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
    table = api[api.index('id="spotguard.run.Run"'):api.index('id="spotguard.run.Run.steps"')]
    assert "<code>agree_at_heartbeat</code>" in table and "peer rank ends the process" in table


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


def _listed(text: str) -> set[str]:
    """The package names of a prose list such as ``a, b, c and d``."""
    return {word.strip("`# \n") for word in re.split(r",|\band\b", text) if word.strip("`# \n")}


def test_the_readme_the_development_guide_and_the_install_script_list_the_same_packages():
    script = (ROOT / "scripts" / "install-system-packages.sh").read_text()
    packages = set(re.findall(r"\[([\w-]+)\]=", re.search(r"command_of=\((.*?)\)", script, re.S)[1]))
    assert {"nodejs", "npm", "prometheus", "slurm-wlm"} <= packages  # Azurite needs Node.js
    readme = re.search(r"the Debian packages (.*?) itself", (ROOT / "README.md").read_text(), re.S)[1]
    guide = re.search(r"`scripts/install-system-packages.sh`:\s*(.*?);",
                      (ROOT / "docs" / "development.md").read_text(), re.S)[1]
    assert _listed(readme) == packages and _listed(guide) == packages, (readme, guide)
    test_run = (ROOT / "scripts" / "test").read_text()
    assert test_run.index("install-system-packages.sh") < test_run.index("install-emulators.sh")


def test_the_site_needs_only_the_docs_extra_and_its_output_is_ignored():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[>=<]", dep)[0] for dep in extras["docs"]}
    assert names == {"mkdocs", "mkdocs-material", "mkdocstrings[python]"}
    assert "spotguard[docs]" in extras["test"]
    assert "/site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_api_reference_documents_every_parameter_of_run_checkpointer_guard_and_the_callbacks():
    """Each parameter has a ``:param NAME:`` in its class's docstring, which mkdocstrings renders
    as the page's parameter table (the site test builds it). Read from the source, not imported."""
    import ast

    for path, name in (("run.py", "Run"), ("checkpoint/manager.py", "Checkpointer"),
                       ("guard.py", "Guard"), ("integrations/lightning.py", "SpotguardCallback"),
                       ("integrations/huggingface.py", "SpotguardTrainerCallback")):
        tree = ast.parse((ROOT / "client" / "spotguard" / path).read_text())
        cls = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)
        init = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
        params = {arg.arg for arg in init.args.args + init.args.kwonlyargs} - {"self"}
        documented = set(re.findall(r":param (\w+):", ast.get_docstring(cls) or ""))
        assert documented == params, (name, params - documented, documented - params)
