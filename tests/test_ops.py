"""The qla:: custom ops: opcheck, autograd wiring and torch.compile with dynamic shapes."""
import pytest
import torch
from gdn_inputs import make_inputs, rel_err
from torch._dynamo.testing import CompileCounterWithBackend

from qla_compile import chunk_gated_delta_rule, dispatch
from qla_compile.reference import chunk_gdr_bwd_reference, chunk_gdr_fwd_reference

OP_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")


def _op_args(kw, scale=0.2):
    flags = (
        scale, kw["use_qk_l2norm_in_kernel"], kw.get("use_gate_in_kernel", False),
        kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False), kw["state_v_first"],
    )
    return tuple(kw.get(n) for n in OP_ARGS) + flags


OPCHECK_CASES = {
    "dense_h0": dict(B=2, T=70, H=1, HV=2, K=16, V=8, initial_state=True),
    "varlen_layer_options": dict(
        T=40, H=1, HV=2, K=8, V=16, cu_seqlens=[0, 3, 40], initial_state=True, l2norm=True,
        gate_in_kernel=True, beta_sigmoid=True, state_v_first=True,
    ),
    "no_state": dict(B=1, T=20, H=2, HV=2, K=8, V=8),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_forward(case):
    args = _op_args(make_inputs(**OPCHECK_CASES[case], seed=0))
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(torch.ops.qla.chunk_gdr_fwd.default, args)


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_backward(case):
    kw = make_inputs(**OPCHECK_CASES[case], seed=1)
    args = _op_args(kw)
    o, ht, tt, gb, cp_cache = torch.ops.qla.chunk_gdr_fwd(*args)
    torch.library.opcheck(torch.ops.qla.chunk_gdr_bwd.default, (torch.randn_like(o), torch.randn_like(ht)) + args)
    torch.library.opcheck(torch.ops.qla.chunk_gdr_bwd.default, (torch.randn_like(o), None) + args + (tt, gb, cp_cache))


def _fresh(T, cu_seqlens=None, seed=0):
    return make_inputs(T=T, H=2, HV=4, K=16, V=16, l2norm=True, cu_seqlens=cu_seqlens, initial_state=True, seed=seed)


class GraphRecorder:
    """A torch.compile backend that keeps every graph it is handed and runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def test_compile_dynamic_one_graph_many_lengths():
    recorder = GraphRecorder()
    fn = torch.compile(chunk_gated_delta_rule, backend=recorder, fullgraph=True, dynamic=True)
    for i, T in enumerate((5, 64, 77, 130, 200)):
        kw = _fresh(T, seed=i)
        o, ht = fn(**kw, output_final_state=True)
        ro, rht = chunk_gated_delta_rule(**kw, output_final_state=True)
        torch.testing.assert_close(o, ro)
        torch.testing.assert_close(ht, rht)
    assert len(recorder.graphs) == 1
    targets = [node.target for node in recorder.graphs[0].graph.nodes]
    assert targets.count(torch.ops.qla.chunk_gdr_fwd.default) == 1


def test_compile_dynamic_varlen_one_graph():
    recorder = GraphRecorder()
    fn = torch.compile(chunk_gated_delta_rule, backend=recorder, fullgraph=True, dynamic=True)
    for i, cu in enumerate(([0, 10, 50], [0, 1, 64, 100, 101], [0, 33, 64, 70])):
        kw = _fresh(cu[-1], cu_seqlens=cu, seed=i)
        torch.testing.assert_close(fn(**kw)[0], chunk_gated_delta_rule(**kw)[0])
    assert len(recorder.graphs) == 1


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_compile_dynamic_hopper_aux(varlen, dynamic, monkeypatch):
    """The Hopper path's saved aux, simulated on the CPU (reference numbers, aux as the kernels shape it): no graph
    break in a training forward (every output size known from shapes, the context-parallel cache's too), one
    dynamic graph for every length, also where n_slots = T // 64 + N is 1, and the backward gets the forward's
    tt, gb and context-parallel cache."""
    pytest.importorskip("tilelang")
    from qla_compile.kernels import cp_cache_numel

    seen = []

    def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, for_backward, keys_normalised):
        assert for_backward and keys_normalised  # the inputs require grad; the norm is lifted into the graph
        tt, gb = dispatch.aux_like(q, k, v, cu_seqlens, for_backward=True)
        o, ht = chunk_gdr_fwd_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
        cache = dispatch.cp_cache_like(q, k, v, cu_seqlens, for_backward)
        return o, ht, tt.fill_(1), gb.fill_(2), cache.fill_(3)

    def backward(*args):
        *args, aux = args
        seen.append(aux)
        return chunk_gdr_bwd_reference(*args)

    monkeypatch.setattr(dispatch, "choose", lambda q, k, v: ("hopper", "simulated on the CPU"))
    monkeypatch.setattr(dispatch, "forward", forward)
    monkeypatch.setattr(dispatch, "backward", backward)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()  # no automatic-dynamic state from earlier compiles of the function
    fn = torch.compile(chunk_gated_delta_rule, backend=counter, fullgraph=True, dynamic=dynamic)
    # the first (traced) case's sizes all differ (N = 5, T = 50, H = 2, H_v = 4, K = V = 16): dynamo's duck sizing
    # would otherwise give equal sizes one symbol and guard on their relation
    cases = ([0, 5, 10, 30, 40, 50], [0, 1, 64, 100, 101], [0, 33, 64, 70]) if varlen else ([0, 5], [0, 64], [0, 77], [0, 200])
    for i, cu in enumerate(cases):
        kw = _fresh(cu[-1], cu_seqlens=cu if varlen else None, seed=i)
        leaves = [kw[n].requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, ht = fn(**kw, output_final_state=True)
        torch.autograd.grad(o.square().sum() + ht.sin().sum(), leaves)
        tt, gb, cp_cache = seen[-1]
        slots = (cu[-1] // 64 + len(cu) - 1) * 4  # H_v = 4
        assert tt.shape == (slots * 64 * 64,) and tt.dtype == torch.float16 and tt.eq(1).all()
        assert gb.shape == (slots * 2 * 64,) and gb.dtype == torch.float32 and gb.eq(2).all()
        assert cp_cache.shape == (cp_cache_numel(cu[-1], len(cu) - 1, 4, 16, 16),) and cp_cache.eq(3).all()
        assert cp_cache.numel() > 0
    assert counter.frame_count == (1 if dynamic else 2)  # automatic dynamic: the first length static


def test_forward_is_told_whether_a_backward_follows(monkeypatch):
    """The op keeps its backward's context-parallel cache only when autograd will call that backward."""
    seen = []
    real = dispatch.forward_keeping  # what the op's forward and eager calls' forward run

    def forward(*args, **kwargs):
        seen.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "forward_keeping", forward)
    kw = _fresh(70)
    chunk_gated_delta_rule(**kw)
    with torch.no_grad():
        chunk_gated_delta_rule(**{n: t.requires_grad_() if n == "v" else t for n, t in kw.items()})
    chunk_gated_delta_rule(**kw)
    assert seen == [False, False, True]


def _assert_compiled_matches_eager(kw, leaves, backend):
    """A loss of the op's output and final state, eager and compiled (``fullgraph``): equal values, and
    gradients of ``leaves`` within 1e-5."""
    def loss(**inputs):
        o, ht = chunk_gated_delta_rule(**inputs, output_final_state=True)
        return o.square().sum() + ht.sin().sum()

    results = []
    for fn in (loss, torch.compile(loss, backend=backend, fullgraph=True)):
        inputs = {n: (x.detach().clone().requires_grad_() if n in leaves else x) for n, x in kw.items()}
        value = fn(**inputs)
        value.backward()
        results.append((value, [inputs[n].grad for n in leaves]))
    (v0, g0), (v1, g1) = results
    torch.testing.assert_close(v1, v0)
    for name, a, b in zip(leaves, g1, g0):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_matches_eager(backend):
    """AOTAutograd puts the backward op in the joint graph; gradients equal eager autograd."""
    kw = make_inputs(B=2, T=70, H=1, HV=2, K=16, V=16, initial_state=True, l2norm=True, seed=3)
    _assert_compiled_matches_eager(kw, ("q", "k", "v", "g", "beta", "initial_state"), backend)


def test_compiled_call_lifts_the_activations_into_the_graph():
    """In a traced call the L2 norm, gate activation and beta sigmoid run as torch ops of the graph (for
    Inductor to fuse) and the op takes ready inputs; values and every gradient (A_log and dt_bias too) equal the
    eager call, whose op applies them itself."""
    kw = make_inputs(T=70, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 30, 70], initial_state=True, l2norm=True,
                     gate_in_kernel=True, beta_sigmoid=True, state_v_first=True, seed=4)
    recorder = GraphRecorder()
    _assert_compiled_matches_eager(kw, ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"), recorder)
    (calls,) = [[n for n in gm.graph.nodes if "qla.chunk_gdr_fwd" in str(n.target)] for gm in recorder.graphs]
    (call,) = calls
    assert call.args[5] is None and call.args[6] is None  # A_log, dt_bias: applied in the graph
    assert call.args[10:14] == (False, False, False, False) and call.args[14] is True  # flags off, v-first kept
