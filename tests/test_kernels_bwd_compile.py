"""The SM90 backward kernels lower and build for sm_90a on a machine without a GPU.

Kept to five builds (CI has two cores): the per-chunk gradient kernel once (it has no flags) and the two
recurrences once per dtype, the bf16 build with every optional input and the fp16 build with none.
"""
import importlib.util
import shutil

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
    reason="needs tilelang and nvcc",
)

VARIANTS = [
    ("chunk_grads", dict(dtype="bfloat16")),
    ("chunk_dstates", dict(dtype="float16", has_h0=False, has_dht=False, block_dv=64)),
    ("chunk_dstates", dict(dtype="bfloat16", has_h0=True, has_dht=True, block_dv=128)),
    ("chunk_states", dict(dtype="bfloat16", has_h0=True, block_dv=128)),
    ("chunk_states", dict(dtype="float16", has_h0=False, block_dv=64)),
]


@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p['dtype']}" for n, p in VARIANTS])
def test_builds_for_sm90a(name, params, tmp_path, monkeypatch):
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    from qla_compile.kernels import gdr_bwd

    kernel = getattr(gdr_bwd, name).__wrapped__(dk=128, dv=128, **params)  # uncached: a real build
    source = kernel.get_kernel_source()
    assert "wgmma" in source  # the GEMMs went to Hopper's warpgroup MMA
