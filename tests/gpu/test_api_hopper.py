"""The public API on an H100/H200: dispatch routes to the Hopper kernels, forward and gradients match the
float64 oracle, and the op compiles as one graph. Runs only where CUDA with SM90 is present."""
import pytest
import torch
from gdn_inputs import make_inputs, rel_err

from qla_compile import chunk_gated_delta_rule, dispatch, recurrent_gdr_reference

pytestmark = pytest.mark.gpu

LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
CASES = {
    "dense_gva_l2norm_h0": dict(B=2, T=200, H=2, HV=4, l2norm=True, initial_state=True),
    "varlen_fla_layer_options": dict(
        T=300, H=1, HV=4, cu_seqlens=[0, 1, 130, 130, 300], gate_in_kernel=True, beta_sigmoid=True,
        state_v_first=True, initial_state=True, l2norm=True,
    ),
    "fp16_odd_T": dict(B=1, T=131, H=2, HV=2, dtype=torch.float16),
}


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _leaves(kw, dtype=None):
    out = dict(kw)
    for name in LEAVES:
        if name in out:
            x = out[name].detach()
            out[name] = (x if dtype is None else x.to(dtype)).requires_grad_()
    return out


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("case", CASES)
def test_hopper_path_matches_oracle(case):
    spec = {"K": 128, "V": 128, "dtype": torch.bfloat16, **CASES[case]}
    kw = make_inputs(**spec, device="cuda")
    assert dispatch.select(kw["q"], kw["k"], kw["v"]) == "hopper"
    ours, ref = _leaves(kw), _leaves(kw, torch.float64)
    o, ht = chunk_gated_delta_rule(**ours, output_final_state=True)
    ro, rht = recurrent_gdr_reference(**ref, output_final_state=True)
    assert o.dtype == spec["dtype"] and rel_err(o, ro) < 5e-3 and rel_err(ht, rht) < 5e-3
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    names = [n for n in LEAVES if n in kw]
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), [ours[n] for n in names])
    rgrads = torch.autograd.grad((ro * do.double()).sum() + (rht * dht.double()).sum(), [ref[n] for n in names])
    errors = {n: rel_err(a, b) for n, a, b in zip(names, grads, rgrads)}
    # Issue 5's bar. Known gap (H200, 2026-11-29): the bf16 backward's dg reached 1.29e-2 on the dense case.
    assert all(e < 1e-2 for e in errors.values()), errors


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_hopper_op_compiles_once_for_many_lengths():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(chunk_gated_delta_rule, backend=record, fullgraph=True, dynamic=True)
    for i, T in enumerate((70, 333, 1024)):
        kw = make_inputs(B=1, T=T, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=i)
        torch.testing.assert_close(fn(**kw)[0], chunk_gated_delta_rule(**kw)[0], rtol=0, atol=0)
    assert len(graphs) == 1
