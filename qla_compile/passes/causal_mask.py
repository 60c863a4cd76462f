"""Attention on a materialised causal mask as ``is_causal=True`` attention.

Under ``torch.compile`` transformers (5.17, 5.24) builds the full-attention layers' causal mask as a
``[B, 1, T, T]`` boolean tensor (while tracing it cannot read ``position_ids`` to rule out packed sequences,
and before torch 2.14 dynamo answers ``torch.compiler.is_exporting()`` with True), where eagerly it passes no
mask and ``is_causal=True``. SDPA then runs a kernel that reads the mask and computes every block of the ``T x T``
product instead of skipping the upper triangle: on the H200, Qwen3-Next's attention at T = 4096 takes twice
its eager time, and the mask alone is ``T^2`` bytes (a GiB at T = 32768).

This pass, on dynamo's torch-level graph, gives such a call ``is_causal=True`` and no mask when the mask is
provably the causal one, with queries and keys of the same length: it is computed from shape symbols only (no
tensor input: a padding mask, packed ``position_ids`` or a cache keep it; nothing written into it in place),
and either the graph is for one length and the mask, evaluated once on its device, is the lower triangle; or
its constants are small (``MAX_CONSTANT``: a sliding window or a chunk size is a constant of the graph) and,
evaluated on the CPU at lengths beyond every such constant, it is the lower triangle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._pytree import tree_leaves

from .dataflow import value

MAX_CONSTANT = 256  # a dynamic-length mask with a larger constant (a window, a chunk) is left as it is
MAX_STATIC_LENGTH = 65536  # a one-length mask is evaluated as it is, on its device, up to this length
_ROWS = 4096  # rows of the lower triangle compared at a time
_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def drop_causal_masks(gm: fx.GraphModule, kept: list[str] | None = None) -> int:
    """Rewrite each SDPA call of ``gm`` whose mask is provably causal; returns how many. For each mask left
    because it is computed from tensor inputs of the graph, appends to ``kept`` a line naming them."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        given = {**dict(zip(_SDPA_ARGS, node.args)), **node.kwargs}
        mask = given.get("attn_mask")
        if not isinstance(mask, fx.Node) or given.get("is_causal", False):
            continue
        nodes = _ancestors(mask)
        tensors = [n.name for n in nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor)]
        if tensors and kept is not None:
            kept.append(f"{node.name}: its mask is computed from the graph's tensor input(s) {', '.join(tensors)} "
                        "(an attention_mask, position_ids, a cache); where nothing is padded or packed, passing "
                        "none lets it run as is_causal attention")
        if tensors or not _causal(given, mask, nodes):
            continue
        given.update(attn_mask=None, is_causal=True)
        node.args, node.kwargs = (), given
        for unused in (n for n in reversed(nodes) if not n.users and n.op != "placeholder"):
            gm.graph.erase_node(unused)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _causal(given: dict, mask: fx.Node, nodes: list[fx.Node]) -> bool:
    """Whether ``mask``, computed by ``nodes``, is the causal mask of the SDPA call with arguments ``given`` (see
    the module docstring)."""
    q, k, m = value(given.get("query")), value(given.get("key")), value(mask)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, m)) or m.dtype != torch.bool or q.dim() != 4:
        return False
    length = q.shape[-2]
    if str(length) != str(k.shape[-2]):
        return False
    inputs = [n for n in nodes if n.op == "placeholder"]
    if any(n.op not in ("placeholder", "call_function", "call_method") for n in nodes):
        return False
    if any(not u.users and u.op != "output" for n in nodes for u in n.users):
        return False  # a write in place (dynamo's graphs keep no other unused node): not what nodes compute
    if any(not isinstance(value(n), (torch.SymInt, int)) for n in inputs):
        return False  # a tensor input (the caller has told why)
    if not inputs:  # a graph for one length: the mask itself, evaluated once (as each step does), is the proof
        return (isinstance(length, int) and length <= MAX_STATIC_LENGTH
                and _is_lower_triangle(_subgraph(nodes, inputs, mask, cpu=False), {}, length))
    constants = [abs(c) for n in nodes for c in tree_leaves((n.args, n.kwargs))
                 if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if max(constants, default=0) > MAX_CONSTANT:
        return False
    symbols = getattr(getattr(length, "node", None), "expr", None)
    if symbols is None:
        return False
    mask_of = _subgraph(nodes, inputs, mask, cpu=True)
    for size in (3, 37, 2 * MAX_CONSTANT + 3):
        at = {s: size for s in symbols.free_symbols}
        values = {n: _at(value(n), at) for n in inputs}
        if not _is_lower_triangle(mask_of, values, int(symbols.subs(at))):
            return False
    return True


def _is_lower_triangle(mask_of: fx.GraphModule, values: dict, n: int) -> bool:
    try:
        out = mask_of(*values.values())
    except Exception:  # noqa: BLE001  (a mask we cannot evaluate at this size is not proven)
        return False
    if out.dim() != 4 or tuple(out.shape[-2:]) != (n, n):
        return False
    columns = torch.arange(n, device=out.device)
    for start in range(0, n, _ROWS):
        rows = torch.arange(start, min(start + _ROWS, n), device=out.device)
        if not torch.equal(out[..., start:start + _ROWS, :], (columns <= rows[:, None]).expand_as(
                out[..., start:start + _ROWS, :])):
            return False
    return True


def _at(value, at: dict) -> int:
    """A symbol input's value with the query length's symbols at ``at`` and any other (a batch size) at 2."""
    if isinstance(value, int):
        return value
    expr = value.node.expr
    return int(expr.subs({s: at.get(s, 2) for s in expr.free_symbols}))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = {node}, [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _subgraph(nodes: list[fx.Node], inputs: list[fx.Node], output: fx.Node, cpu: bool) -> fx.GraphModule:
    """The mask's computation as a module of its shape-symbol inputs (moved to the CPU with ``cpu``)."""
    graph, env = fx.Graph(), {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            continue
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        if cpu and "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
        if cpu and node.op == "call_method" and node.target == "to":  # .to(device) of a mask built elsewhere
            args = (args[0],) + tuple("cpu" if isinstance(a, (str, torch.device)) else a for a in args[1:])
        env[node] = graph.create_node(node.op, node.target, args, kwargs, node.name)
    graph.output(env[output])
    return fx.GraphModule(torch.nn.Module(), graph)
