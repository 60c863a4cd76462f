"""Front door: the known eager GDN functions trace as one qla op, found at run time, registered idempotently."""
import functools

import torch
from torch.profiler import ProfilerActivity, profile

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
        assert frontdoor.is_substituted(fn)


def test_a_kernels_hub_function_module_stands_for_its_function():
    """transformers 5.25 with Hugging Face's ``kernels`` installed binds a model's GDN function to an ``nn.Module``
    that ``kernels`` made of it (a local class ``Func`` whose ``forward`` calls the function): the front door goes
    through it to the functions below."""

    def gdn(x):
        return x

    def create_func_module(func):  # the shape of kernels' ``_create_func_module`` + ``use_kernel_forward_from_hub``
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    wrapper = functools.wraps(gdn)(lambda *a, **k: gdn(*a, **k))  # transformers' hub fallback wrapper
    module = create_func_module(wrapper)
    assert list(frontdoor.unwrap_chain(module)) == [wrapper, gdn]
    assert list(frontdoor.unwrap_chain(torch.nn.Linear(2, 2))) == []  # any other module stands for nothing


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


def _transformers_fn():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    frontdoor.register_substitutions()
    return m.torch_chunk_gated_delta_rule


def _gdn_args(T):
    kw = make_inputs(T=T, H=2, HV=4, K=16, V=16, l2norm=True, seed=T)
    return tuple(kw[n] for n in ("q", "k", "v", "g", "beta"))


def test_eager_calls_run_the_original_body():
    """The front door leaves eager calls alone: the function's own body runs (no qla op), bit for bit."""
    fn = _transformers_fn()
    plain = list(frontdoor.unwrap_chain(fn))[-1]
    body = frontdoor.eager_body(plain)
    assert body is not plain  # the plain function's code was taken, its body kept
    args = _gdn_args(90)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        o, st = fn(*args, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert not [e.key for e in prof.key_averages() if "qla" in e.key]
    o_ref, st_ref = body(*args, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(st, st_ref)


def test_a_substitute_that_fails_to_trace_runs_our_op_not_the_unrolled_loop(monkeypatch):
    """Should dynamo fail to trace the substitute (here a forced graph break inside it), it must not trace the
    original's own frame (the chunk loop, unrolled, one recompile per length): our op runs after a graph break,
    and every graph stays small."""
    from qla_compile.patterns import known_functions

    fn = _transformers_fn()
    real = known_functions.chunk_gated_delta_rule

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return real(*args, **kwargs)

    monkeypatch.setattr(known_functions, "chunk_gated_delta_rule", breaking)
    sizes = []

    def count_nodes(gm, example_inputs):
        sizes.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = torch.compile(lambda *a: fn(*a, use_qk_l2norm_in_kernel=True, output_final_state=True),
                             backend=count_nodes)
    body = frontdoor.eager_body(list(frontdoor.unwrap_chain(fn))[-1])
    for T in (70, 130, 300):
        args = _gdn_args(T)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            o, st = compiled(*args)
        assert "qla::chunk_gdr_fwd" in {e.key for e in prof.key_averages()}
        o_ref, st_ref = body(*args, use_qk_l2norm_in_kernel=True, output_final_state=True)
        assert rel_err(o, o_ref) < 1e-5 and rel_err(st, st_ref) < 1e-5
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) > breaks  # the break is dynamo's, logged
    assert sizes and max(sizes) < 60, sizes  # no unrolled chunk loop (that is 100+ nodes at these lengths)


def test_lazy_transformers_packages_are_not_asked_for_attributes(monkeypatch):
    """A transformers package module resolves a missing attribute by importing its submodules (on 5.17 one of
    them needs torchvision): discovery and the import hook look at the module's own namespace only."""
    import sys
    import types

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ImportError(f"{name}: would import a submodule that needs torchvision")

    lazy = Lazy("transformers.models.lazy_family")
    monkeypatch.setitem(sys.modules, lazy.__name__, lazy)
    frontdoor._register_if_gdn(lazy)  # no error, nothing to register
    assert lazy.__name__ not in transformers_gdn_modules(import_all=False)
