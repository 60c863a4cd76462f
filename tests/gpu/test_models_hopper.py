"""The product path on an H100/H200: GPU-shaped (K = V = 128) transformers models under ``qla_compile.backend``,
in train and eval mode, with the Hopper kernels behind every GDN call. On the CPU the reference path runs and
none of this (fake-implementation sizes of the Hopper outputs, proofs on CUDA tensors, graph breaks in train
mode) can be seen."""
import contextlib
import copy
import sys

import pytest
import torch
from gdn_inputs import make_inputs, rel_err
from torch.profiler import ProfilerActivity, profile

import qla_compile as qb
from qla_compile import dispatch, ops
from qla_compile.passes import frontdoor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs an SM90 GPU")]

VOCAB = 256


def _config(family, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                  layer_types=["linear_attention", "full_attention", "linear_attention"])
    common.update(overrides)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextForCausalLM, Qwen3NextConfig(**common, mlp_only_layers=[0, 1, 2])
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM, Qwen3_5TextConfig(**common)


def _model(family, dtype=torch.bfloat16, **overrides):
    cls, cfg = _config(family, **overrides)
    torch.manual_seed(0)
    return cls(cfg).to("cuda", dtype)


@contextlib.contextmanager
def _gdn_as(model, fn):
    """Within: the model's GDN layers call ``fn`` in eager mode (transformers binds FLA when it imports, whose
    Triton autotuning takes minutes per shape)."""
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    saved = module.torch_chunk_gated_delta_rule
    module.torch_chunk_gated_delta_rule = fn
    try:
        yield
    finally:
        module.torch_chunk_gated_delta_rule = saved


def _torch_gdn(model):
    """transformers' own PyTorch GDN (its chunk loop, fp32 inside), the eager reference."""
    fn = sys.modules[type(model.model.layers[0].linear_attn).__module__].torch_chunk_gated_delta_rule
    return frontdoor.eager_body(getattr(fn, "__wrapped__", fn))


def _qla_gdn(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """Our op called eagerly (its Hopper kernels are checked against the float64 oracle elsewhere)."""
    return qb.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _train_step(model, fn, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = fn(input_ids=ids, use_cache=False, **kwargs).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def _gdn_layers(model):
    return sum(t == "linear_attention" for t in model.config.layer_types)


def _grad_err(grads, ref):
    """Relative error of all gradients together, and of the GDN layers' input projection's alone."""
    every = rel_err(torch.cat([grads[n].flatten() for n in ref]), torch.cat([ref[n].flatten() for n in ref]))
    proj = [n for n in ref if "linear_attn.in_proj" in n]
    return max(every, *(rel_err(grads[n], ref[n]) for n in proj))


@pytest.mark.parametrize("for_backward", [False, True])
@pytest.mark.parametrize("case", [
    dict(B=1, T=9000, H=2, HV=4),  # splits into pieces (context parallel)
    dict(B=3, T=700, H=2, HV=64),  # never splits (too many v-heads)
    dict(T=5000, H=1, HV=2, cu_seqlens=[0, 4200, 4200, 5000]),  # varlen, splits
])
def test_fake_sizes_match_the_hopper_outputs(case, for_backward):
    """opcheck's fake-tensor test on the Hopper path: every output of the forward, the context-parallel cache
    included, has the size the fake implementation gives from shapes alone."""
    kw = make_inputs(K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=1, **case)
    assert dispatch.select(kw["q"], kw["k"], kw["v"]) == "hopper"
    args = tuple(kw.get(n) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"))
    args += (128 ** -0.5, False, False, False, False, False, for_backward)
    torch.library.opcheck(ops.chunk_gdr_fwd, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("family, inductor", [("qwen3_next", True), ("qwen3_5", False)])
def test_model_trains_as_one_graph_with_our_kernels(family, inductor):
    """Train mode, ``fullgraph=True`` (so no graph break), two lengths: every GDN layer's forward and backward
    is our op on the Hopper kernels (Inductor plans their output buffers from the fake sizes), and logits and
    all gradients are as close to an fp32 eager model as the bf16 eager model's are (within 2x, or 1e-2)."""
    model = _model(family)
    ref_model = copy.deepcopy(model).float()
    qb.register_substitutions()
    backend = qb.make_backend(inductor=inductor)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for T in (1000, 2100):
        ids = torch.randint(0, VOCAB, (2, T), device="cuda", generator=torch.Generator("cuda").manual_seed(T))
        _train_step(model, compiled, ids)  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits, grads = _train_step(model, compiled, ids)
        calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("qla::")}
        assert calls == {"qla::chunk_gdr_fwd": _gdn_layers(model), "qla::chunk_gdr_bwd": _gdn_layers(model)}, calls
        with _gdn_as(model, _torch_gdn(model)):
            eager_logits, eager_grads = _train_step(model, model, ids)
            ref_logits, ref_grads = _train_step(ref_model, ref_model, ids)
        assert rel_err(logits, ref_logits) <= max(2 * rel_err(eager_logits, ref_logits), 1e-2)
        assert _grad_err(grads, ref_grads) <= max(2 * _grad_err(eager_grads, ref_grads), 1e-2)
    assert len(backend.reports) <= 2 and all(r.fused_calls == _gdn_layers(model) for r in backend.reports)


def test_model_trains_on_packed_sequences():
    """``cu_seq_lens_q`` reaches the GDN layers: our varlen op runs forward and backward with the packing's
    boundaries (the op's varlen results are checked against the float64 oracle in ``test_api_hopper``), and the
    logits and gradients are the eager model's with our op eagerly (transformers' own PyTorch GDN cannot keep
    packed sequences apart)."""
    model = _model("qwen3_next")
    cu = torch.tensor([0, 700, 710, 1800, 3000], device="cuda", dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (1, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    qb.register_substitutions()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=qb.make_backend(inductor=False), fullgraph=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        logits, grads = _train_step(model, compiled, ids, cu_seq_lens_q=cu)
    calls = {e.key: e.input_shapes for e in prof.events() if e.key.startswith("qla::chunk_gdr_")}
    assert set(calls) == {"qla::chunk_gdr_fwd", "qla::chunk_gdr_bwd"}, calls
    # A varlen call: among the forward's inputs, the packing's offsets (5: no other input has that shape).
    assert [len(cu)] in calls["qla::chunk_gdr_fwd"], calls
    with _gdn_as(model, _qla_gdn):
        eager_logits, eager_grads = _train_step(model, model, ids, cu_seq_lens_q=cu)
    assert rel_err(logits, eager_logits) < 1e-2
    assert _grad_err(grads, eager_grads) < 2e-2


def test_chunked_prefill_carries_the_state():
    """A prompt prefilled in two chunks with a cache: the second chunk's GDN calls start from the first's final
    state (``initial_state``), and its logits match the one-shot prefill of the whole prompt."""
    model = _model("qwen3_next").eval()
    ids = torch.randint(0, VOCAB, (1, 1500), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    qb.register_substitutions()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=qb.make_backend(inductor=False))
    with torch.no_grad(), _gdn_as(model, _torch_gdn(model)):
        whole = model(input_ids=ids, use_cache=False).logits.float()
    with torch.no_grad():
        out = compiled(input_ids=ids[:, :1000], use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            second = compiled(input_ids=ids[:, 1000:], past_key_values=out.past_key_values, use_cache=True)
    assert "qla::chunk_gdr_fwd" in {e.key for e in prof.key_averages()}
    assert rel_err(second.logits.float(), whole[:, 1000:]) < 2e-2


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_eager_model_trains_on_our_op_with_transformers_layout(family):
    """Eagerly, our op behind transformers' GDN call (as FLA's registry puts it there): q, k and v arrive as
    slices of the transposed convolution output (a row's elements a sequence length apart), which the L2-norm
    launch reads as they are; logits and gradients are as close to an fp32 model as transformers' own bf16
    PyTorch GDN's (within 2x, or 1e-2). As many value heads as key heads: with more, transformers repeats q and k
    into contiguous copies and only v would arrive strided."""
    model = _model(family, linear_num_value_heads=2)
    ref_model = copy.deepcopy(model).float()
    ids = torch.randint(0, VOCAB, (2, 1100), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    layouts = []

    def ours(query, key, value, *args, **kwargs):
        layouts.append(query.stride(1) < query.stride(3) and value.stride(1) < value.stride(3))
        return _qla_gdn(query, key, value, *args, **kwargs)

    with _gdn_as(model, ours):
        logits, grads = _train_step(model, model, ids)
    assert layouts == [True] * _gdn_layers(model), layouts
    with _gdn_as(model, _torch_gdn(model)):
        eager_logits, eager_grads = _train_step(model, model, ids)
        ref_logits, ref_grads = _train_step(ref_model, ref_model, ids)
    assert rel_err(logits, ref_logits) <= max(2 * rel_err(eager_logits, ref_logits), 1e-2)
    assert _grad_err(grads, ref_grads) <= max(2 * _grad_err(eager_grads, ref_grads), 1e-2)
