"""Front door: the known eager GDN functions trace as one qla op, found at run time, registered idempotently."""
import torch

from gdn_inputs import make_inputs, rel_err
from qla_compile.passes import frontdoor
from qla_compile.patterns.known_functions import transformers_gdn_modules


def test_discovers_every_transformers_gdn_module_and_registers_once():
    modules = transformers_gdn_modules(import_all=True)
    assert {"qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"} <= {m.split(".")[2] for m in modules}
    frontdoor.register_substitutions(import_all=True)
    assert frontdoor.register_substitutions(import_all=True) == []  # idempotent
    import importlib

    for name in modules:
        fn = importlib.import_module(name).torch_chunk_gated_delta_rule
        assert frontdoor.is_substituted(fn) and frontdoor.is_substituted(fn.__wrapped__)


def test_decorated_function_traces_one_op_for_every_length():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as fn

    frontdoor.register_substitutions()
    graphs = []

    def count_graphs(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a, use_qk_l2norm_in_kernel=True, output_final_state=True),
                             backend=count_graphs, fullgraph=True)
    for T in (10, 64, 65, 150, 300):
        kw = make_inputs(T=T, H=2, HV=4, K=16, V=16, l2norm=True, seed=T)
        args = tuple(kw[n] for n in ("q", "k", "v", "g", "beta"))
        (o, st), (o_ref, st_ref) = compiled(*args), fn(*args, use_qk_l2norm_in_kernel=True, output_final_state=True)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(st, st_ref) < 1e-5
    assert len(graphs) <= 2  # static first, then one dynamic graph for every other length
    assert all(sum("chunk_gdr_fwd" in str(t) for t in g) == 1 for g in graphs)
    assert all(len(g) < 30 for g in graphs)  # no unrolled chunk loop
