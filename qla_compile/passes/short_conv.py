"""The GDN layer's short convolution as shifted multiply-adds that Inductor fuses.

transformers' GDN layers (Qwen3-Next, Qwen3.5), without the ``causal-conv1d`` package, run their causal
depthwise convolution (kernel 4 over ``2 K H_qk + V H_v`` channels) as ``F.conv1d(..., groups=channels)``, and
on the GPU that is ATen's generic depthwise kernel: on the H200, ~1 ms forward and ~1.6 ms backward per 3
layers x 4096 tokens x 8192 channels, about 9x what its bytes take, and more of a training step than the GDN
op itself. Written as ``K`` shifted products, Inductor fuses it with the concatenation before and the
activation after into one pass over the activations, and its backward into a pass and a reduction.

The rewrite runs on dynamo's torch-level graph, before AOTAutograd, and takes a ``conv1d`` node only when its
example values show a depthwise, stride-1, undilated 1-D convolution of a batched input with a kernel of at
most ``MAX_TAPS``. The products are summed in fp32 and rounded once, as ATen's kernels accumulate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from .dataflow import value

MAX_TAPS = 8  # longer kernels stay convolutions: the shifted form unrolls one product per tap
_CONV1D = (torch.conv1d, F.conv1d)


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, padding=padding, groups=x.shape[1])`` for ``weight`` of shape ``[C, 1, taps]``."""
    taps = weight.shape[-1]
    padded = F.pad(x, (padding, padding)).float()
    length = padded.shape[-1] - taps + 1
    w = weight[:, 0].float().unsqueeze(-1)  # [C, taps, 1]: tap j broadcast over the tokens
    out = padded[..., 0:length] * w[:, 0]
    for j in range(1, taps):
        out = out + padded[..., j:j + length] * w[:, j]
    if bias is not None:
        out = out + bias.float().unsqueeze(-1)
    return out.to(torch.result_type(x, weight))


def rewrite_short_convs(gm: fx.GraphModule) -> int:
    """Replace each depthwise short ``conv1d`` call of ``gm`` by ``depthwise_conv1d``; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        args = _depthwise_args(node)
        if args is None:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(depthwise_conv1d, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _depthwise_args(node: fx.Node):
    """``(x, weight, bias, padding)`` of a ``conv1d`` node that ``depthwise_conv1d`` computes, else None."""
    if node.op != "call_function" or node.target not in _CONV1D:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = dict(bias=None, stride=1, padding=0, dilation=1, groups=1)
    given = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
    if set(given) - set(names) or "input" not in given or "weight" not in given:
        return None
    x, weight = value(given["input"]), value(given["weight"])
    stride, padding, dilation = (_single(given[k]) for k in ("stride", "padding", "dilation"))
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)) or x.dim() != 3 or weight.dim() != 3:
        return None
    channels, per_group, taps = weight.shape
    bias = given["bias"]
    if isinstance(bias, fx.Node) and not isinstance(value(bias), torch.Tensor):
        return None
    if (stride, dilation) != (1, 1) or not isinstance(padding, int) or padding < 0 or given["groups"] != channels:
        return None
    if per_group != 1 or x.shape[1] != channels or not isinstance(taps, int) or taps > MAX_TAPS:
        return None
    return given["input"], given["weight"], bias, padding


def _single(arg):
    """An int, or a 1-tuple of one, as an int; anything else (a string padding, a node) as it is."""
    if isinstance(arg, (tuple, list)) and len(arg) == 1:
        arg = arg[0]
    return arg
