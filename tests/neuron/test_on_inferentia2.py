"""On a real inf2 host only (skipped elsewhere by tests/conftest.py): the smoke run with the real SDK."""
import json
import subprocess
import sys

from conftest import ROOT


def test_neuron_smoke_on_hardware(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "neuron_smoke.py"), "--model", "tiny-llama-neuron",
                          "--checkpoint", str(tiny_model_dir), "--workdir", str(tmp_path / "smoke")],
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "smoke" / "report.json").read_text())
    assert report["compile_cache"]["new_entries"] == 0
