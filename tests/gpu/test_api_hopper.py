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
    # Issue 5's bar. Known tail: on the dense l2norm case bf16 dg exceeds it in about 1 draw in 100 (FLA in 7,
    # FlashQLA in 5; bench/results/2026-11-30-dg-tail.md).
    bars = {n: 1e-2 * _sum_condition(ref, dict(zip(names, rgrads))["g"], n) for n in ("A_log", "dt_bias") if n in kw}
    assert all(e < bars.get(n, 1e-2) for n, e in errors.items()), (errors, bars)


def _sum_condition(ref, dg_raw, name):
    """dA_log and ddt_bias are per-head sums over tokens of dg o d(gate)/d(param), so their relative error is
    dg's times the sums' condition number ||sum |terms| || / ||sum terms|| (at least 1), from the oracle."""
    from torch.func import jvp

    from qla_compile.reference import gate_activation

    a, A, dt = (ref[n].detach() for n in ("g", "A_log", "dt_bias"))
    args = {"g": a, "A_log": A, "dt_bias": dt}

    def d_gate(wrt):  # d gate[..., h] / d wrt, elementwise (every gate element depends on one entry of wrt)
        return jvp(lambda x: gate_activation(**{**args, wrt: x}), (args[wrt],), (torch.ones_like(args[wrt]),))[1]

    terms = dg_raw.detach() / d_gate("g") * d_gate(name)
    dims = tuple(range(terms.dim() - 1))
    return max(1.0, (terms.abs().sum(dims).norm() / terms.sum(dims).norm()).item())


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


# what the backward must not recompute when autograd hands it the forward's aux: (inputs, module, function)
_REUSE_CASES = {
    # T~ and [gamma; beta]: kkt_inverse does not run in the backward
    "aux": (dict(T=333, H=2, HV=4, cu_seqlens=[0, 70, 71, 250, 333], seed=5), "kkt_inverse", "kkt_inverse"),
    # a context-parallel forward's pieces: no warm-up plan, transitions or scan before the state recompute
    "cp-cache": (dict(T=9000, H=1, HV=2, cu_seqlens=[0, 8300, 9000], seed=7), "backward", "_piece_initial_states"),
}


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("case", list(_REUSE_CASES))
def test_saved_aux_gives_bitwise_the_same_gradients(case, monkeypatch):
    """Autograd reuses what the forward saved instead of recomputing it in the backward (T~ and [gamma; beta];
    a context-parallel forward's piece states and transitions) and gets bitwise the gradients of the Hopper
    backward that recomputes it."""
    import importlib

    from qla_compile.kernels import backward

    inputs, module, function = _REUSE_CASES[case]
    kw = make_inputs(K=128, V=128, initial_state=True, dtype=torch.bfloat16, device="cuda", **inputs)
    assert dispatch.select(kw["q"], kw["k"], kw["v"]) == "hopper"
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = _leaves(kw)
    o, ht = chunk_gated_delta_rule(**leaves, output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    monkeypatch.setattr(importlib.import_module(f"qla_compile.kernels.{module}"), function,
                        lambda *a, **k: pytest.fail(f"the backward called {function}"))
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in names], (do, dht))
    monkeypatch.undo()
    recomputed = backward.chunk_gdr_bwd_hopper(do, dht, *(kw[n] for n in names[:5]), 128**-0.5, kw["initial_state"],
                                               kw["cu_seqlens"])
    for name, a, b in zip(names, grads, recomputed):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_compiled_training_saves_aux():
    """Compiled training saves the aux with the fake's symbolic size (one graph for every length, also T < 64,
    where n_slots is 1, and T = 8192, where the forward runs context-parallel and its cache has a data-dependent
    size) and gets bitwise eager's gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(chunk_gated_delta_rule, backend=counter, fullgraph=True, dynamic=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for i, T in enumerate((40, 200, 333, 8192)):
        kw = make_inputs(B=1, T=T, H=2, HV=4, K=128, V=128, initial_state=True, dtype=torch.bfloat16, device="cuda",
                         seed=i)
        do = torch.randn(1, T, 4, 128, device="cuda").to(torch.bfloat16)
        dht = torch.randn(1, 4, 128, 128, device="cuda")
        results = []
        for f in (chunk_gated_delta_rule, fn):
            leaves = _leaves(kw)
            o, ht = f(**leaves, output_final_state=True)
            results.append(torch.autograd.grad((o, ht), [leaves[n] for n in names], (do, dht)))
        for name, a, b in zip(names, *results):
            assert torch.equal(a, b), (T, name)
    assert counter.frame_count == 1


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("seqs", [[300, 900], [256] * 128], ids=["T~ path", "inverse on chip"])
def test_forward_alone_keeps_no_aux(seqs):
    """A forward no backward follows returns no T~ or [gamma; beta] (the op's real outputs and its fake's agree),
    allocates none where it forms the inverse on chip (128 sequences x 1 v-head: the route), and its output meets
    the float64 oracle as does the one of a forward that keeps them (bitwise the same where both take one route and
    no split: the two split rules cut different pieces); a backward given that empty aux recomputes them (bitwise
    the gradients of the Hopper backward without aux)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qla_compile import ops
    from qla_compile.kernels import backward, forward

    cu = [0]
    for n in seqs:
        cu.append(cu[-1] + n)
    kw = make_inputs(T=cu[-1], H=1, HV=1, K=128, V=128, cu_seqlens=cu, dtype=torch.bfloat16, device="cuda")
    kw["cu_seqlens"] = kw["cu_seqlens"].to(torch.int32)
    assert forward._onchip_inverse(len(seqs)) == (len(seqs) >= 128)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, None, None, kw["cu_seqlens"], 128**-0.5,
            False, False, False, False, False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    alone = ops.chunk_gdr_fwd(*args, False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    kept = ops.chunk_gdr_fwd(*args, True)
    assert alone[2].numel() == alone[3].numel() == 0 and kept[2].numel() > 0
    ref = _leaves(kw, torch.float64)
    ro, rht = recurrent_gdr_reference(**{n: ref[n] for n in ("q", "k", "v", "g", "beta")},
                                      cu_seqlens=kw["cu_seqlens"], output_final_state=True)
    for out in (alone, kept):
        assert rel_err(out[0], ro) < 5e-3 and rel_err(out[1], rht) < 5e-3
    if len(seqs) >= 128:  # the forward alone inverts on chip, the one that keeps T~ reads it
        # the peak: o, the final state, the fp32 gates and small tables, no T~-sized buffer
        tt_bytes = kept[2].numel() * 2
        needed = alone[0].numel() * 2 + alone[1].numel() * 4 + kw["g"].numel() * 8
        assert peak < needed + tt_bytes // 4, (peak, needed, tt_bytes)
    else:  # one route: bitwise the same
        assert torch.equal(alone[0], kept[0]) and torch.equal(alone[1], kept[1])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.chunk_gdr_fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args), False)
    for real, f in zip(alone, fake):
        assert real.shape == f.shape and real.dtype == f.dtype
    do = torch.randn_like(kw["v"])
    grads = ops.chunk_gdr_bwd(do, None, *args[:15], alone[2], alone[3], alone[4])
    recomputed = backward.chunk_gdr_bwd_hopper(do, None, *args[:5], 128**-0.5, None, kw["cu_seqlens"])
    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads, recomputed):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_l2norm_forward_reads_no_keys_for_the_gates(compiled, monkeypatch):
    """A forward alone with ``use_qk_l2norm_in_kernel``, context-parallel with a qk-head per v-head (4 pieces x 32
    v-heads), tells the Hopper forward that its keys come normalised (eagerly by the op's own norm, compiled by the
    norm lifted into the graph: the op's ``keys_normalised``), so the gate pass reads no K
    (``kkt_inverse(unit_keys=True)``); output and final state meet the float64 oracle."""
    from qla_compile.kernels import forward

    seen, gate_inverse = [], forward._gate_inverse
    monkeypatch.setattr(forward, "_gate_inverse", lambda *a, **k: seen.append(k) or gate_inverse(*a, **k))
    kw = make_inputs(T=4096, H=32, HV=32, K=128, V=128, l2norm=True, initial_state=True, dtype=torch.bfloat16,
                     device="cuda")
    fn = torch.compile(chunk_gated_delta_rule, fullgraph=True) if compiled else chunk_gated_delta_rule
    with torch.no_grad():
        o, ht = fn(**kw, output_final_state=True)
        ro, rht = recurrent_gdr_reference(**_leaves(kw, torch.float64), output_final_state=True)
    assert [(s["inverse"], s["unit_keys"]) for s in seen] == [(False, True)]
    assert rel_err(o, ro) < 5e-3 and rel_err(ht, rht) < 5e-3
