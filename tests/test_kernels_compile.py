"""The SM90 forward kernels lower and build for sm_90a on a machine without a GPU.

Eleven builds (CI has two cores, ~30 s each): the grouped inverse in both dtypes, the tensor-core one
(``kkt_inverse_tc``) in bf16, the bf16 fused kernel with an initial state and the full V tile, the fp16 one with
neither, so both branches of each flag compile, the split-state recurrence (bf16 with an initial state; fp16
without, forming its inverse on chip), the two context-parallel kernels (the pieces'
transitions and the piece scan) and the varlen table kernel.
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
    ("kkt_inverse_tc", dict(dk=128, dtype="bfloat16")),
    ("chunk_fwd_ws", dict(dk=128, dv=128, dtype="bfloat16", has_h0=True, block_dv=128)),
    ("chunk_fwd_ws", dict(dk=128, dv=128, dtype="float16", has_h0=False, block_dv=64)),
    ("chunk_fwd_split", dict(dk=128, dv=128, dtype="bfloat16", has_h0=True)),
    ("chunk_fwd_split", dict(dk=128, dv=128, dtype="float16", has_h0=False, inverse=True)),
    ("scan", dict(dk=128, dv=128, has_h0=True)),
    ("transitions", dict(dk=128, dv=128, dtype="bfloat16")),
    ("warmup_plan", dict()),
    ("seq_tables", dict(cu_dtype="int64")),
]


def _id(name, params):
    tags = [params.get("dtype", params.get("cu_dtype", "fp32"))] + ["inverse"] * params.get("inverse", False)
    return "-".join([name] + tags)


@pytest.mark.parametrize("name,params", VARIANTS, ids=[_id(n, p) for n, p in VARIANTS])
def test_builds_for_sm90a(name, params, tmp_path, monkeypatch):
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QLA_PREBUILT", "0")
    from qla_compile.kernels import chunk_recurrence, context_parallel, kkt_inverse, seq_tables, split_state_recurrence

    module = {"chunk_fwd_ws": chunk_recurrence, "scan": context_parallel, "warmup_plan": context_parallel,
              "transitions": context_parallel,
              "seq_tables": seq_tables, "chunk_fwd_split": split_state_recurrence}.get(name, kkt_inverse)
    kernel = getattr(module, name).__wrapped__(**params)  # uncached: a real build
    source = kernel.get_kernel_source()
    # the GEMMs went to Hopper's warpgroup MMA (the scan's small FP32 product: TF32 mma.sync)
    if name not in ("seq_tables", "warmup_plan"):
        assert ("mma_sync" if name == "scan" else "wgmma") in source
    if name in ("chunk_fwd_ws", "chunk_fwd_split", "transitions"):
        assert "tma_load" in source  # inputs stream through the bulk tensor copy engine
    if name == "kkt_inverse_tc" or params.get("inverse"):
        assert "mma.sync" in source  # the tile's inverse on tensor cores (tile_inverse)
    if name == "chunk_fwd_split":
        # V^T in and O^T out as 8x8 matrices (ldmatrix/stmatrix .trans), not element by element
        assert "ptx_ldmatrix_x4_trans" in source and "ptx_stmatrix_m8n8_x4_trans" in source

