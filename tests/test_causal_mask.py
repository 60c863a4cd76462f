"""The causal-mask rewrite: attention on a mask proven causal becomes ``is_causal=True``; any other mask stays."""
import pytest
import torch
import torch.nn.functional as F

from qla_compile.passes.causal_mask import drop_causal_masks


def _attend(q, k, v, pad=None, window=None):
    """Attention on a materialised mask, built the way transformers builds it while tracing."""
    T = q.shape[-2]
    kv, qi = torch.arange(T)[None, None, None, :], torch.arange(T)[None, None, :, None]
    mask = torch.ones((), dtype=torch.bool) & (kv <= qi)
    if window is not None:
        mask = mask & (kv > qi - window)
    if pad is not None:
        mask = mask & pad[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(q.shape[0], 1, T, T))


def _graph(fn, dynamic, *args):
    """Dynamo's graph of ``fn`` and its inputs (length symbols as the lengths of ``args``)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, [x.node.hint if isinstance(x, torch.SymInt) else x for x in example_inputs]))
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    (graph,) = graphs
    return graph


def _qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, T, 8, generator=g) for _ in range(3)]


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_causal_mask_becomes_is_causal(dynamic):
    q, k, v = _qkv(21)
    gm, inputs = _graph(_attend, dynamic, q, k, v)
    assert drop_causal_masks(gm) == 1
    (call,) = _sdpa_calls(gm)
    assert call.kwargs["is_causal"] is True and call.kwargs["attn_mask"] is None
    assert not any(n.op == "call_function" and n.target is torch.arange for n in gm.graph.nodes)  # mask erased
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(gm(*inputs)[0], reference)


@pytest.mark.parametrize("window", [8, 4096])
def test_a_sliding_window_mask_stays(window):
    q, k, v = _qkv(21)
    gm, inputs = _graph(lambda q, k, v: _attend(q, k, v, window=window), True, q, k, v)
    assert drop_causal_masks(gm) == 0  # 8: differs from causal at 515 tokens; 4096: a large constant
    torch.testing.assert_close(gm(*inputs)[0], _attend(q, k, v, window=window))


def test_a_mask_with_padding_stays():
    q, k, v = _qkv(21)
    pad = torch.ones(2, 21, dtype=torch.bool)  # all True: causal on this input, but an input of the graph
    gm, inputs = _graph(lambda q, k, v, pad: _attend(q, k, v, pad=pad), True, q, k, v, pad)
    assert drop_causal_masks(gm) == 0
    assert _sdpa_calls(gm)[0].kwargs.get("attn_mask") is not None


def test_a_mask_written_in_place_stays():
    """A write into the mask after it is built (here: the first key hidden) is not part of what its own node
    computes; the pass does not take it for causal."""
    def attend(q, k, v):
        T = q.shape[-2]
        mask = torch.arange(T)[None, None, None, :] <= torch.arange(T)[None, None, :, None]
        mask = mask.expand(q.shape[0], 1, T, T).clone()
        mask[..., 1:, 0] = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = _qkv(21)
    gm, inputs = _graph(attend, True, q, k, v)
    assert drop_causal_masks(gm) == 0
    torch.testing.assert_close(gm(*inputs)[0], attend(q, k, v))
