"""The SM90 forward kernels against the float64 per-token oracle (H200)."""
import math

import pytest
import torch

from gdn_inputs import make_inputs, rel_err
from qla_compile.reference import recurrent_gdr_reference

pytestmark = pytest.mark.gpu

TOL = 5e-3


def _kernels():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    import qla_compile.kernels as kernels

    return kernels


def _case(B, T, H, HV, dtype, cu_seqlens=None, h0=True, l2norm=False, seed=0):
    kw = make_inputs(B, T, H, HV, 128, 128, cu_seqlens=cu_seqlens, initial_state=h0, l2norm=l2norm,
                     dtype=dtype, device="cuda", seed=seed)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 128**-0.5, kw.get("initial_state"),
            kw.get("cu_seqlens"), l2norm)
    return kw, args


CASES = {
    # name: (B, T, H, HV, dtype, cu_seqlens, h0, l2norm)
    "dense-gva4-T300-h0": (2, 300, 2, 8, torch.bfloat16, None, True, False),
    "dense-T1000-fp16": (1, 1000, 4, 4, torch.float16, None, False, False),
    "varlen-1tok-empty-h0": (1, 452, 2, 4, torch.bfloat16, [0, 1, 2, 130, 130, 194, 451, 452], True, False),
    "varlen-gva2-fp16-h0": (1, 777, 2, 4, torch.float16, [0, 63, 64, 65, 777], True, False),
    "l2norm-in-kernel": (1, 200, 2, 2, torch.bfloat16, None, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_oracle(name):
    kernels = _kernels()
    B, T, H, HV, dtype, cu, h0, l2 = CASES[name]
    kw, args = _case(B, T, H, HV, dtype, cu, h0, l2, seed=len(name))
    o, ht = kernels.chunk_gdr_fwd_hopper(*args)
    ref_o, ref_ht = recurrent_gdr_reference(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw.get("initial_state"),
        output_final_state=True, cu_seqlens=kw.get("cu_seqlens"), use_qk_l2norm_in_kernel=l2,
    )
    assert o.dtype == dtype and o.shape == kw["v"].shape
    assert ht.dtype == torch.float32 and ht.shape == ref_ht.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, ref_o) <= TOL, rel_err(o, ref_o)
    assert rel_err(ht, ref_ht) <= TOL, rel_err(ht, ref_ht)


def test_every_output_element_written(monkeypatch):
    """Outputs allocated inside the call are poisoned with NaN; none may survive."""
    kernels = _kernels()
    _, args = _case(1, 452, 2, 4, torch.bfloat16, [0, 1, 2, 130, 130, 194, 451, 452], True)
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(math.nan) if t.is_floating_point() else t.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(torch, "empty_like", lambda x, **k: poisoned(x.shape, dtype=k.get("dtype", x.dtype),
                                                                     device=x.device))
    o, ht = kernels.chunk_gdr_fwd_hopper(*args)
    assert not o.isnan().any() and not ht.isnan().any()


@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_replay_equals_eager(varlen):
    kernels = _kernels()
    cu = [0, 100, 101, 400] if varlen else None
    _, args = _case(1 if varlen else 2, 400 if varlen else 200, 2, 8, torch.bfloat16, cu, True)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kernels.chunk_gdr_fwd_hopper(*static)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = kernels.chunk_gdr_fwd_hopper(*static)
    _, fresh = _case(1 if varlen else 2, 400 if varlen else 200, 2, 8, torch.bfloat16, cu, True, seed=7)
    for dst, src in zip(static, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    o, ht = kernels.chunk_gdr_fwd_hopper(*fresh)
    torch.cuda.synchronize()
    assert torch.equal(o_g, o) and torch.equal(ht_g, ht)


def test_repeated_runs_bitwise_identical():
    kernels = _kernels()
    _, args = _case(1, 3000, 4, 16, torch.bfloat16, [0, 1000, 1001, 3000], True)
    first = kernels.chunk_gdr_fwd_hopper(*args)
    for _ in range(3):
        again = kernels.chunk_gdr_fwd_hopper(*args)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_supported_and_rejected_inputs():
    kernels = _kernels()
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert kernels.hopper_supported(q, q, v)
    assert not kernels.hopper_supported(q.float(), q.float(), v.float())
    assert not kernels.hopper_supported(q[..., :64], q[..., :64], v)
    assert not kernels.hopper_supported(q, q, v[:, :, :3])
    g = torch.zeros(1, 64, 3, device="cuda")
    with pytest.raises(ValueError, match="g must have shape"):
        kernels.chunk_gdr_fwd_hopper(q, q, v, g, g, 1.0)
