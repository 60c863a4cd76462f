"""FLA's ``chunk_gated_delta_rule`` and its ``GatedDeltaNet`` layer under our backend, and our backend in FLA's
registry (``fla_checks.py``).

Each runs in a subprocess with FLA importable: in this process FLA stays off ``sys.path`` (see
``legacy_sources.py``).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legacy_sources import fla_pythonpath

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("case", ["op", "layer", "registry", "verifier", "fla_calls_our_op", "routing", "leaves",
                                  "leaves_first_trace"])
def test_fla_under_backend(case):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fla_pythonpath(), str(TESTS)])}
    out = subprocess.run([sys.executable, str(TESTS / "fla_checks.py"), case], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert f"{case} OK" in out.stdout
