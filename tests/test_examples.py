"""The README's quickstart runs and reports a match with the oracle."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    err = float(re.search(r"oracle: ([0-9.e+-]+)", out.stdout).group(1))
    assert err < 1e-4
    assert "graphs compiled for the three lengths: 1" in out.stdout
