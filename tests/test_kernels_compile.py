"""The SM90 forward kernels lower and build for sm_90a on a machine without a GPU.

Four builds (CI has two cores, ~30 s each): the inverse in both dtypes, the bf16 fused kernel with an
initial state and the full V tile, the fp16 one with neither, so both branches of each flag compile.
``python -m qla_compile.prebuild`` builds every variant.
"""
import importlib.util
import shutil

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
    reason="needs tilelang and nvcc",
)

VARIANTS = [
    ("kkt_inverse", dict(dk=128, dtype="bfloat16")),
    ("kkt_inverse", dict(dk=128, dtype="float16")),
    ("chunk_fwd_ws", dict(dk=128, dv=128, dtype="bfloat16", has_h0=True, block_dv=128)),
    ("chunk_fwd_ws", dict(dk=128, dv=128, dtype="float16", has_h0=False, block_dv=64)),
]


@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p['dtype']}" for n, p in VARIANTS])
def test_builds_for_sm90a(name, params, tmp_path, monkeypatch):
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    from qla_compile.kernels import fused_fwd, gdr_fwd

    module = fused_fwd if name == "chunk_fwd_ws" else gdr_fwd
    kernel = getattr(module, name).__wrapped__(**params)  # uncached: a real build
    source = kernel.get_kernel_source()
    assert "wgmma" in source  # the GEMMs went to Hopper's warpgroup MMA
    if name == "chunk_fwd_ws":
        assert "tma_load" in source  # inputs stream through the bulk tensor copy engine

