"""The fault-injection suite at its small size (tests/faults.py; the full suite
and its figures: docs/lifecycle.md).

Three kinds once each, about half a minute on 2 cores: a SIGKILL of a rank,
a full disk, a damaged checkpoint. The other kinds take the same paths as
one of these or are tested on their own: a stopping signal (SIGTERM, SIGINT,
SIGUSR1) checkpoints and resumes in tests/test_lifecycle.py and
tests/test_engine_train.py, bit-identically in the Slurm requeue test of
tests/test_jobs_slurm.py; a read-only file system fails a write as a full
one does. The full suite (make test-long) injects all seven.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

FAULTS = Path(__file__).resolve().parent / "faults.py"


@pytest.mark.timeout(400)
def test_faults_are_survived(tmp_path):
    report = tmp_path / "faults.json"
    argv = [sys.executable, str(FAULTS), "--each", "--size", "small", "--kinds",
            "sigkill,disk-full,corrupt", "--seed", "3", "--json", str(report)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 lost" in result.stdout, result.stdout
    summary = json.loads(report.read_text())["summary"]
    ran = {kind for kind, count in summary["by_kind"].items() if count}
    # disk-full needs root (a tmpfs); the rest run everywhere
    assert {"sigkill", "corrupt"} <= ran
    assert summary["survived"] == summary["faults_injected"] >= 2
    assert summary["bit_identical_finishes"] + summary["clean_refusals"] == summary["survived"]
