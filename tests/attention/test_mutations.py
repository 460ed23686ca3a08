"""A few of tests/mutations.py's planted bugs, in CI: each must make the suite fail (the whole list runs on
demand: `python tests/mutations.py`)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "mutations.py"


def test_planted_bugs_are_caught():
    proc = subprocess.run([sys.executable, str(SCRIPT), "causal_off_by_one", "lse_offset", "sink_grad_sign"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 of 3 planted bugs caught" in proc.stdout, proc.stdout
