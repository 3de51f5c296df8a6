"""scripts/bench/prefill_profile.py: prompt times per length, each side in processes of its own. Speeds are
never asserted: only what is timed, how the sides alternate and what the table says."""
import re

import pytest

from scripts.bench import prefill_profile


def test_each_prefill_of_each_length_is_timed_from_an_empty_slot(tiny_model_dir):
    from llama_engine.backends import torch_backend

    times = prefill_profile.prefill_times(torch_backend, str(tiny_model_dir), [8, 24], prefills=3)
    assert sorted(times) == [8, 24]
    assert all(len(ms) == 3 and min(ms) > 0 for ms in times.values())


def test_a_side_runs_in_a_process_of_its_own_and_reports_its_medians(tiny_model_dir, capsys):
    """Two processes a side against HEAD's backend, alternated; each row has each process's median."""
    assert prefill_profile.main(["--model", str(tiny_model_dir), "--lengths", "8,24", "--prefills", "2",
                                 "--processes", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("baseline HEAD")
    rows = {line.split("|")[0].strip(): line for line in out[2:4]}
    assert sorted(rows) == ["24", "8"]
    for line in rows.values():
        _, base, new, ratio = (cell.strip() for cell in line.split("|"))
        assert len(base.split("/")) == 2 and len(new.split("/")) == 2 and ratio.endswith("x")
    assert re.fullmatch(r"TTFT\(24\) / TTFT\(8\): base [\d.]+/[\d.]+, new [\d.]+/[\d.]+", out[4])


def test_without_a_baseline_only_the_current_code_runs(tiny_model_dir, capsys):
    assert prefill_profile.main(["--model", str(tiny_model_dir), "--lengths", "8", "--prefills", "1",
                                 "--processes", "1", "--threads", "1", "--no-baseline"]) == 0
    out = capsys.readouterr().out.splitlines()
    _, base, new, ratio = (cell.strip() for cell in out[2].split("|"))
    assert base == "-" and ratio == "-" and float(new) > 0 and len(out) == 3


def test_a_failing_side_names_itself_with_the_workers_error(tiny_model_dir):
    with pytest.raises(SystemExit, match="baseline side failed"):
        prefill_profile.main(["--model", str(tiny_model_dir), "--lengths", "8", "--prefills", "1",
                              "--processes", "1", "--baseline", "no-such-revision"])


@pytest.mark.parametrize("lengths", ["", "0,8", "8,x"])
def test_lengths_must_be_positive_integers(tiny_model_dir, lengths):
    with pytest.raises(SystemExit):
        prefill_profile.main(["--model", str(tiny_model_dir), "--lengths", lengths])


def test_a_model_directory_without_a_config_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prefill_profile.main(["--model", str(tmp_path)])
    assert "has no config.json" in capsys.readouterr().err
