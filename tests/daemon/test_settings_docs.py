"""README's settings reference is the one generated from the Settings model: every field documented."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
reference = runpy.run_path(str(ROOT / "scripts" / "settings-reference"))


def test_readme_holds_the_current_settings_reference():
    section = reference["readme_section"]((ROOT / "README.md").read_text())
    assert section == reference["table"](), "run scripts/settings-reference --write"


def test_every_setting_has_a_docstring():
    undocumented = [name for name, _, doc in reference["rows"]() if not doc]
    assert undocumented == []
