"""Smoke test of bench_checkpoint_compare.py: one round of two variants in this process, tiny state.
The figures are checked for plausibility only (this machine may be loaded)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_checkpoint_compare as bench  # noqa: E402


def test_spotguard_and_torch_save_rounds_measure_save_restore_and_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "BATCH", 8)
    monkeypatch.setattr(bench, "BASE_STEPS", 6)
    monkeypatch.setattr(bench, "WARM_STEPS", 2)
    monkeypatch.setattr(bench, "CONTROL_STEPS", 4)
    rows = {v: bench.run_variant(v, 0.004, False, tmp_path) for v in ("torch_save", "spotguard", "no_save", "dd")}
    control = rows.pop("no_save")
    assert control["steps_during"] == 4 and control["inflation"] > -1
    for name, row in rows.items():
        assert row["bytes"] > 3 << 20 and 0 < row["stall_s"] <= row["durable_s"] and row["restore_s"] > 0, name
    assert "inflation" in rows["spotguard"] and 0 <= rows["spotguard"]["restore_peak_rss_extra"] < 5
    table = bench.table({k: {key: v for key, v in r.items() if not key.startswith("_")}
                         for k, r in {**rows, "no_save": control}.items()})
    assert rows["dd"]["parallel_read_s"] > 0 and "restore / parallel read" in table
    assert rows["spotguard"]["files_read_s"] > 0 and "restore / its files read" in table
    spotguard_row = next(line for line in table.splitlines() if line.startswith("| spotguard |"))
    assert spotguard_row.split(" | ")[9].endswith("x")  # restore / its files read, measured
    assert "| spotguard |" in table and "restore / torch.load" in table and "| no_save (control) |" in table
