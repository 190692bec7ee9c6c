"""The settings reference page (docs/reference/settings.md) is the one generated from the Settings
model: every field documented."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
reference = runpy.run_path(str(ROOT / "scripts" / "settings-reference"))


def test_docs_hold_the_current_settings_reference():
    section = reference["page_section"]((ROOT / reference["PAGE"]).read_text())
    assert section == reference["table"](), "run scripts/settings-reference --write"


def test_every_setting_has_a_docstring():
    undocumented = [name for name, _, doc in reference["rows"]() if not doc]
    assert undocumented == []
