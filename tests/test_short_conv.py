"""The short-convolution rewrite: which ``conv1d`` calls it takes, and that they compute what they did."""
import pytest
import torch
import torch.nn.functional as F

from gdn_inputs import rel_err
from qla_compile.passes.short_conv import depthwise_conv1d, rewrite_short_convs


@pytest.mark.parametrize("taps,padding,bias", [(4, 3, False), (4, 3, True), (3, 1, True), (2, 0, False)])
def test_depthwise_conv1d_matches_float64_conv_forward_and_backward(taps, padding, bias):
    g = torch.Generator().manual_seed(taps * 10 + padding)
    x = torch.randn(2, 24, 37, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, 1, taps, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    dy = torch.randn(2, 24, 37 + 2 * padding - taps + 1, generator=g, dtype=torch.float64)
    leaves = [t for t in (x, w, b) if t is not None]
    ref = F.conv1d(x, w, b, padding=padding, groups=24)
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    low = [t.detach().to(torch.bfloat16).requires_grad_() for t in leaves]
    out = depthwise_conv1d(low[0], low[1], low[2] if bias else None, padding)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out.double(), ref) < 1e-2
    for grad, ref_grad in zip(torch.autograd.grad(out, low, dy.to(torch.bfloat16)), ref_grads):
        assert rel_err(grad.double(), ref_grad) < 2e-2


def _graph_of(fn, *args):
    """Dynamo's graph of ``fn`` and the example inputs it takes (closed-over tensors become inputs too)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (graph,) = graphs
    return graph


def test_rewrite_takes_depthwise_short_convs_only():
    x = torch.randn(2, 16, 30)
    depthwise, short = torch.randn(16, 1, 4), torch.randn(16, 1, 12)
    dense, bias = torch.randn(16, 16, 4), torch.randn(16)

    def fn(x):
        return (F.conv1d(x, depthwise, padding=3, groups=16)[..., :30],        # taken
                torch.conv1d(x, depthwise, bias, 1, (3,), 1, 16),               # taken (positional, tuple pad)
                F.conv1d(x, depthwise, padding=3, groups=16, stride=2),         # strided
                F.conv1d(x, depthwise, padding=3, groups=16, dilation=2),       # dilated
                F.conv1d(x, short, padding=11, groups=16),                      # 12 taps > MAX_TAPS
                F.conv1d(x, dense, padding=3),                                  # not depthwise
                F.conv1d(x, depthwise, padding="valid", groups=16))             # a string padding
    gm, inputs = _graph_of(fn, x)
    expected = fn(x)
    assert rewrite_short_convs(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(depthwise_conv1d) == 2
    for out, ref in zip(gm(*inputs), expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
