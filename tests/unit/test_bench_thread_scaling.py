"""scripts.bench.thread_scaling: its thread counts, its rows and table. Speeds are never asserted: only
that every row was measured, at the threads asked, and that the weights' rate is the step's bytes over
its time."""
import json

import pytest
import torch

from scripts.bench import thread_scaling
from scripts.bench.model import describe


def test_default_threads_double_up_to_every_usable_cpu():
    assert thread_scaling.default_threads(1) == [1]
    assert thread_scaling.default_threads(2) == [1, 2]
    assert thread_scaling.default_threads(6) == [1, 2, 4, 6]
    assert thread_scaling.default_threads(16) == [1, 2, 4, 8, 16]


def test_a_row_per_dtype_and_thread_count_with_the_threads_restored(tiny_model_dir, tmp_path, capsys):
    before = torch.get_num_threads()
    out = tmp_path / "rows.json"
    assert thread_scaling.main(["--model", str(tiny_model_dir), "--threads", "1,2", "--dtypes", "float32,bfloat16",
                                "--prompt-tokens", "40", "--repeats", "1", "--json", str(out)]) == 0
    assert torch.get_num_threads() == before
    rows = json.loads(out.read_text())
    assert [(r["dtype"], r["threads"]) for r in rows] == [("float32", 1), ("float32", 2), ("bfloat16", 1),
                                                          ("bfloat16", 2)]
    step_bytes = describe(tiny_model_dir, "float32")["weight_bytes_per_token"]
    for row in rows:
        assert row["prefill40_ms"] > 0 and row["decode1_ms"] > 0 and row["decode8_ms"] > 0 and row["read_gb_s"] > 0
        assert row["weight_dtype"] == row["dtype"]  # the tiny checkpoint is stored in float32
    assert rows[0]["decode1_weights_gb_s"] == pytest.approx(step_bytes / rows[0]["decode1_ms"] / 1e6, rel=0.01)
    table = capsys.readouterr().out
    assert "| dtype | weight_dtype | threads | read_gb_s | native_layers | prefill40_ms |" in table
    assert table.count("| float32 | float32 |") == 2
