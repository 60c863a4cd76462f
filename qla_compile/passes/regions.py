"""Find candidate GDN regions in a dynamo FX graph: anchors, outputs, and the nodes in between.

1. **Anchor**: a ``cumsum`` whose pairwise differences are exponentiated (the chunk decay mask
   ``exp(G_i - G_j)``), present in every chunked GDN form and in none of plain or softmax attention.
2. **Outputs**: the first node all of the anchor's flow passes through (its immediate post-dominator),
   extended through layout-only ops; when a final state leaves too, the state is tried as a second exit.
3. **Region**: grown backwards from the outputs over nodes whose whole flow ends in the outputs and whose op
   an eager GDN may use (``REGION_OPS``); growth stops at projections, activations, placeholders and at
   gates built from parameters, which become the region's inputs.

A region is only a candidate: ``prove.py`` decides whether it is a gated delta rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..patterns.graph_anchors import (
    CUMSUM, EXP, LAYOUT, MUTATING, PAIRWISE_MASKS, PAIRWISE_VIEWS, REGION_OPS, RESHAPES, SUB,
)
from .dataflow import Dataflow, is_tensor, op_name, value

_MAX_OUTPUT_EXTENSION = 8


@dataclass
class Region:
    anchor: fx.Node
    outputs: list[fx.Node]                     # [o] or [o, final_state]
    nodes: list[fx.Node] = field(default_factory=list)    # in graph order
    inputs: list[fx.Node] = field(default_factory=list)   # in graph order


def find_anchors(flow: Dataflow) -> list[fx.Node]:
    """cumsum nodes whose pairwise differences feed an exp."""
    return [n for n in flow.nodes if op_name(n) in CUMSUM and _has_pairwise_exp(flow, n)]


def _has_pairwise_exp(flow: Dataflow, c: fx.Node) -> bool:
    views = {c}
    frontier = [c]
    for _ in range(3):
        frontier = [u for n in frontier for u in flow.users[n] if op_name(u) in PAIRWISE_VIEWS and u not in views]
        views.update(frontier)
    for n in views:
        for s in flow.users[n]:
            if op_name(s) in SUB and sum(a in views for a in s.args if isinstance(a, fx.Node)) == 2:
                frontier = [s]
                for _ in range(4):
                    if any(op_name(x) in EXP for x in frontier):
                        return True
                    frontier = [u for x in frontier for u in flow.users[x] if op_name(u) in PAIRWISE_MASKS | EXP]
    return False


def output_candidates(flow: Dataflow, anchor: fx.Node) -> list[list[fx.Node]]:
    """Possible output sets for the region of ``anchor``, most fused first: [o] or [o, final_state]."""
    ipdom = flow.post_dominators()
    first = ipdom[anchor]
    if first is not flow.sink:
        return [[o] for o in _layout_extensions(flow, first)]
    candidates = []
    for state in _state_exits(flow, anchor):
        first = flow.post_dominators(ignore=flow.covered_by([state]))[anchor]
        if first is not flow.sink and first is not state:
            candidates += [[o, state] for o in _layout_extensions(flow, first)]
    return candidates


def _layout_extensions(flow: Dataflow, node: fx.Node) -> list[fx.Node]:
    """``node`` and the chain of single-user layout ops after it that keep four dims, farthest first."""
    chain = [node]
    for _ in range(_MAX_OUTPUT_EXTENSION):
        users = flow.users[chain[-1]]
        if len(users) != 1 or op_name(users[0]) not in LAYOUT or users[0].args[0] is not chain[-1]:
            break
        chain.append(users[0])
    return [n for n in reversed(chain) if is_tensor(n) and value(n).dim() == 4]


def _state_exits(flow: Dataflow, anchor: fx.Node) -> list[fx.Node]:
    """4-D descendants of the anchor that leave the graph directly (a returned final state), last first."""
    desc = flow.descendants(anchor)
    exits = [n for n in desc if flow.sink in n.users and is_tensor(n) and value(n).dim() == 4]
    return sorted(exits, key=flow.index.__getitem__, reverse=True)


def grow(flow: Dataflow, anchor: fx.Node, outputs: list[fx.Node], split_heads_outside: bool = False) -> Region:
    """The region ending in ``outputs``: every node it may own, and the nodes it reads from outside.

    With ``split_heads_outside``, 3-D inputs reshaped to 4-D (a head split, or a chunking of the gates: which
    one only the proof can tell) are taken after the reshape.
    """
    covered = flow.covered_by(outputs)
    region, inputs = set(), set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in flow.args[n]:
            if a in region:
                continue
            if a in covered and _may_own(a):
                stack.append(a)
            else:
                inputs.add(a)
    inputs -= region
    if split_heads_outside:
        _pull_in_head_splits(flow, region, inputs)
    order = flow.index.__getitem__
    return Region(anchor, list(outputs), sorted(region, key=order), sorted(inputs, key=order))


def _pull_in_head_splits(flow: Dataflow, region: set, inputs: set) -> None:
    """Leave the head split of an input (``[B,T,H*K] -> [B,T,H,K]``) outside the region.

    The binding knows token- and head-major layouts; a flat input is bound through the reshape's output.
    """
    changed = True
    while changed:
        changed = False
        for x in list(inputs):
            users = [u for u in flow.users[x] if u in region]
            if (len(users) == 1 and op_name(users[0]) in RESHAPES and is_tensor(x) and is_tensor(users[0])
                    and value(x).dim() == 3 and value(users[0]).dim() == 4):
                inputs.discard(x)
                region.discard(users[0])
                inputs.add(users[0])
                changed = True


def _may_own(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method") or op_name(node) not in REGION_OPS:
        return False
    out = value(node)
    if op_name(node) == "getitem" and not isinstance(value(node.args[0]), torch.Tensor):
        return False  # an element of a tuple produced outside (e.g. torch.split): an input
    if not (out is None or isinstance(out, (torch.Tensor, torch.SymInt, torch.SymFloat, int, float))):
        return False
    if op_name(node) in MUTATING:
        return True
    return not any(_parameter_only(a) for a in node._input_nodes if is_tensor(a))


def _parameter_only(node: fx.Node, _depth: int = 0) -> bool:
    """True for a parameter or buffer, or a tensor computed from parameters alone (e.g. ``-A_log.exp()``)."""
    if node.op == "placeholder":
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        name = source.name if source is not None and hasattr(source, "name") else ""
        name = name() if callable(name) else name
        return "_parameters" in name or "_buffers" in name or "parameters[" in name or "buffers[" in name
    tensors = [a for a in node._input_nodes if is_tensor(a)]
    return _depth < 4 and bool(tensors) and all(_parameter_only(a, _depth + 1) for a in tensors)


def mutates_outside(region: Region) -> fx.Node | None:
    """A node of the region that writes into a tensor the region does not own (such a region is left alone)."""
    owned = set(region.nodes)
    for n in region.nodes:
        if op_name(n) in MUTATING and isinstance(n.args[0], fx.Node) and n.args[0] not in owned:
            return n
    return None
