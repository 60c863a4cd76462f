"""The SM90 backward kernels lower and build for sm_90a on a machine without a GPU.

Kept to five builds (CI has two cores): the per-chunk gradient kernel once (with the L2 norm's backward, as eager
calls run it), the reverse
recurrence once per dtype (the bf16 build with every optional input and the full V tile, the fp16 build
with none and half of it) and the state recompute (the fused forward's ``store_h`` mode) at both tiles.
"""
import importlib.util
import shutil

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
    reason="needs tilelang and nvcc",
)

VARIANTS = [
    ("chunk_grads", dict(dtype="bfloat16", l2norm=True)),
    ("chunk_dstates_ws", dict(dtype="float16", has_h0=False, has_dht=False, block_dv=64)),
    ("chunk_dstates_ws", dict(dtype="bfloat16", has_h0=True, has_dht=True, block_dv=128)),
    ("chunk_fwd_ws", dict(dtype="bfloat16", has_h0=True, block_dv=128, store_h=True)),
    ("chunk_fwd_ws", dict(dtype="float16", has_h0=False, block_dv=64, store_h=True)),
]


@pytest.mark.parametrize("name,params", VARIANTS,
                         ids=[f"{n}-{p['dtype']}-{p.get('block_dv', 128)}" for n, p in VARIANTS])
def test_builds_for_sm90a(name, params, tmp_path, monkeypatch):
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QLA_PREBUILT", "0")
    from qla_compile.kernels import chunk_grads, chunk_recurrence, reverse_recurrence

    module = {"chunk_dstates_ws": reverse_recurrence, "chunk_fwd_ws": chunk_recurrence}.get(name, chunk_grads)
    kernel = getattr(module, name).__wrapped__(dk=128, dv=128, **params)  # uncached: a real build
    source = kernel.get_kernel_source()
    assert "wgmma" in source  # the GEMMs went to Hopper's warpgroup MMA
    if name != "chunk_grads":  # the warp-specialised kernels stream their inputs by TMA and store by TMA
        assert "tma_load" in source and "tma_store" in source
    # chunk_grads runs as a programmatic dependent launch of the reverse recurrence, beside it: the recurrence
    # lets it launch and publishes chunks, chunk_grads waits for each and its spare slots for the whole grid
    if name == "chunk_dstates_ws":
        assert "cudaTriggerProgrammaticLaunchCompletion" in source and "qla_ready_signal(" in source
    if name == "chunk_grads":
        assert "qla_ready_wait(" in source and "cudaGridDependencySynchronize" in source
        func = next(iter(kernel.adapter.device_mod.functions.values()))
        assert "has_cuda_pdl_sync" in func.attrs  # so the launch asks for programmatic stream serialization
        assert "q_rstd[" in source and "k_rstd[" in source  # the norms' rstd are read: the L2 norm's backward
