"""The Triton q/k L2 norm of eager Hopper calls (``qla_compile.kernels.qk_l2norm``) against a float64 oracle, run
on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``) in a subprocess, with the Triton of
``.sidepkgs/fla`` (see ``legacy_sources.py``); on the GPU the Hopper tests run it compiled."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legacy_sources import FLA_DIR, fla_pythonpath

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import json, torch
from qla_compile.kernels import qk_l2norm
from qla_compile.reference import l2norm
torch.manual_seed(0)
out = {}
# (name, x): a slice of a fused projection (rows of a token strided), a view the rows cannot address (copied),
# a head dim that is not a power of two, and nothing at all
fused = torch.randn(2, 37, 3 * 4 * 128).to(torch.bfloat16)
cases = [
    ("fused-slice", fused[..., 512:1024].unflatten(-1, (4, 128))),
    ("padded-batch", torch.randn(3, 40, 2, 128).to(torch.bfloat16)[:, :29]),
    ("d96-fp16", torch.randn(1, 9, 3, 96).to(torch.float16)),
    ("empty", torch.randn(1, 0, 2, 128).to(torch.bfloat16)),
]
for name, x in cases:
    dy = torch.randn(x.shape).to(x.dtype)
    xr = x.double().requires_grad_()
    ref = l2norm(xr)
    (ref * dy.double()).sum().backward()
    y, dx = qk_l2norm.l2norm(x), qk_l2norm.l2norm_bwd(x, dy)
    # relative to the exact value (floored far below the rows' scale): a single rounding is half a unit
    err = lambda a, b: ((a.double() - b).abs() / (b.abs() + 1e-4 * b.abs().max())).max().item() if b.numel() else 0.0
    out[name] = dict(contiguous=y.is_contiguous() and dx.is_contiguous(), dtype=str(y.dtype) + str(dx.dtype),
                     shape=list(y.shape) == list(x.shape) == list(dx.shape), y=err(y, ref.detach()),
                     dx=err(dx, xr.grad), want_dtype=str(x.dtype) * 2)
print(json.dumps(out))
"""


def test_triton_l2norm_matches_float64_forward_and_backward():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), fla_pythonpath()]))
    if not (FLA_DIR / "triton").exists():
        pytest.skip("Triton is not in .sidepkgs/fla")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == {"fused-slice", "padded-batch", "d96-fp16", "empty"}
    for name, r in results.items():
        assert r["contiguous"] and r["shape"] and r["dtype"] == r["want_dtype"], (name, r)
        # computed in fp32 and rounded once to the half dtype: half a unit in the last place (fp16: 2^-11
        # relative), plus fp32's error; a whole unit for bf16 (2^-7), which the interpreter rounds by truncating
        unit = 2.0 ** -7 if "bfloat16" in r["want_dtype"] else 2.0 ** -11
        assert r["y"] < 1.05 * unit and r["dx"] < 1.05 * unit, (name, r)
