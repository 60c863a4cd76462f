"""Find candidate GDN regions in a dynamo FX graph: anchors, outputs, and the nodes in between.

1. **Anchor**: a group of seeds linked by short flow paths.  Seeds are in-chunk gate sums (a ``cumsum``, or
   any op's output: a matmul with a lower triangle) whose pairwise differences are exponentiated (the chunk
   decay mask ``exp(G_i - G_j)`` of every chunked form), and *state decays*: a product of a tensor with an
   exponential (``S * exp(g_t)``).  A group is an anchor if it holds a gate-sum seed, or two decays one feeding
   the other within a few ops: the decayed state carried token to token (a recurrence, unrolled) or chunk to
   chunk.  Plain or softmax attention have neither.
2. **Outputs**: the first node all of the group's flow passes through (their common post-dominator), extended
   through layout-only ops; when a final state leaves too, the state is tried as a second exit.  A buffer
   filled in place ends in its last write (``dataflow.written``).
3. **Region**: grown backwards from the outputs over nodes whose whole flow ends in the outputs and whose op
   an eager GDN may use (``REGION_OPS``); growth stops at projections, activations, placeholders and at
   gates built from parameters, which become the region's inputs.  Failing a proof, the boundary is moved
   past what the region does to its inputs alone (``BOUNDARIES``: gate maps, head splits, slices).

A region is only a candidate: ``prove.py`` decides whether it is a gated delta rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..patterns.graph_anchors import (
    DECAY_PRODUCTS, DECAY_VIEWS, EXP, GATE_MAPS, JOINS, LAYOUT, OWNED_TUPLES, PAIRWISE_MASKS, PAIRWISE_VIEWS, REGION_OPS,
    RESHAPES, SUB,
)
from .dataflow import Dataflow, is_mutation, is_tensor, op_name, value, written

_MAX_OUTPUT_EXTENSION = 8
_LINK_OPS = 5          # seeds this many ops apart (through region ops) belong to one anchor
_LINK_VISITS = 64      # nodes a link search from one seed visits at most
_EXP_VIEWS = 4         # view ops between an exponential and the product it decays


@dataclass
class Anchor:
    node: fx.Node             # the group's first cumsum seed, else its first decay (named in the report)
    members: list[fx.Node]    # every seed of the group, in graph order


@dataclass
class Region:
    anchor: fx.Node
    outputs: list[fx.Node]                     # [o] or [o, final_state]; a write stands for its target
    nodes: list[fx.Node] = field(default_factory=list)    # in graph order
    inputs: list[fx.Node] = field(default_factory=list)   # in graph order


def find_anchors(flow: Dataflow) -> list[Anchor]:
    """The seed groups that may be a GDN, in graph order of their anchor nodes."""
    live = [n for n in flow.nodes if n not in flow.dead]
    cumsums = {n for n in live if op_name(n) not in PAIRWISE_VIEWS and is_tensor(n) and _has_pairwise_exp(flow, n)}
    seeds = [n for n in live if n in cumsums or _is_decay(n)]
    anchors = []
    for group in _linked_groups(flow, seeds):
        chunked = [n for n in group if n in cumsums]
        if chunked or len(group) > 1:  # a chunk decay mask, or a decayed state decayed again
            anchors.append(Anchor((chunked or group)[0], group))
    return sorted(anchors, key=lambda a: flow.index[a.node])


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


def _is_decay(node: fx.Node) -> bool:
    """A product of an exponential (through up to ``_EXP_VIEWS`` view ops) with another tensor:
    ``S * exp(g)[..., None, None]``."""
    if op_name(node) not in DECAY_PRODUCTS:
        return False
    factors = [a for a in node._input_nodes if is_tensor(a)]
    from_exp = [_from_exp(a) for a in factors]
    return any(from_exp) and not all(from_exp)


def _from_exp(node: fx.Node) -> bool:
    for _ in range(_EXP_VIEWS + 1):
        if op_name(node) in EXP:
            return True
        if op_name(node) not in DECAY_VIEWS or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return False


def _linked_groups(flow: Dataflow, seeds: list[fx.Node]) -> list[list[fx.Node]]:
    """``seeds`` grouped by flow paths of at most ``_LINK_OPS`` region ops between them, in graph order."""
    parent = {s: s for s in seeds}

    def root(s):
        while parent[s] is not s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for s in seeds:
        seen, frontier = {s}, [s]
        for _ in range(_LINK_OPS):
            frontier = [u for n in frontier for u in flow.users[n] if u not in seen and op_name(u) in REGION_OPS]
            seen.update(frontier)
            for u in frontier:
                if u in parent:
                    parent[root(u)] = root(s)
            if len(seen) > _LINK_VISITS:
                break
    groups: dict[fx.Node, list[fx.Node]] = {}
    for s in seeds:  # graph order
        groups.setdefault(root(s), []).append(s)
    return list(groups.values())


def output_candidates(flow: Dataflow, anchor: Anchor) -> list[list[fx.Node]]:
    """Possible output sets for the region of ``anchor``, most fused first: [o] or [o, final_state]."""
    first = flow.post_dominator(anchor.members)
    if first is not flow.sink:
        return [[o] for o in _layout_extensions(flow, first)]
    candidates = []
    for state in _state_exits(flow, anchor):
        ignore = flow.covered_by([state])
        members = [m for m in anchor.members if m not in ignore]
        first = flow.post_dominator(members, ignore) if members else flow.sink
        if first is not flow.sink and first is not state:
            candidates += [[o, state] for o in _layout_extensions(flow, first)]
    return candidates


def _is_4d(node: fx.Node) -> bool:
    return is_tensor(written(node)) and value(written(node)).dim() == 4


def _layout_extensions(flow: Dataflow, node: fx.Node) -> list[fx.Node]:
    """``node`` and the chain of single-user layout ops after it that keep four dims, farthest first.  A write
    stands for its buffer once the writes after it are done too."""
    while is_mutation(node) and len(flow.users[node]) == 1:
        after = flow.users[node][0]
        if not (is_mutation(after) and written(after) is written(node)):
            break
        node = after
    chain = [node]
    for _ in range(_MAX_OUTPUT_EXTENSION):
        users = flow.users[chain[-1]]
        if len(users) != 1 or not _rearranges(users[0], written(chain[-1])):
            break
        chain.append(users[0])
    return [n for n in reversed(chain) if _is_4d(n)]


def _rearranges(user: fx.Node, node: fx.Node) -> bool:
    """``user`` only lays ``node`` out anew: a layout op on it, or a cat/stack of it alone (of one chunk)."""
    if op_name(user) in JOINS:
        return list(user.args[0]) == [node] if isinstance(user.args[0], (list, tuple)) else False
    return op_name(user) in LAYOUT and user.args[0] is node


def _state_exits(flow: Dataflow, anchor: Anchor) -> list[fx.Node]:
    """4-D descendants of the anchor that leave the graph directly (a returned final state), last first."""
    exits = [n for n in flow.descendants(anchor.members) if flow.sink in flow.users[n] and _is_4d(n)]
    return sorted(exits, key=flow.index.__getitem__, reverse=True)


def grow(flow: Dataflow, anchor: fx.Node, outputs: list[fx.Node], boundary=()) -> Region:
    """The region ending in ``outputs``: every node it may own, and the nodes it reads from outside, whose
    boundary is then moved past what the steps in ``boundary`` (one of ``BOUNDARIES``) leave outside."""
    covered = flow.covered_by(outputs)
    region, inputs = set(), set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in {*flow.args[n], *n._input_nodes}:  # a read rerouted to a write still names its tensor
            if a in region:
                continue
            if a in covered and _owned(flow, a):
                stack.append(a)
            else:
                inputs.add(a)
    inputs -= region
    for step in boundary:
        step(flow, region, inputs)
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


def _leave_gate_maps_outside(flow: Dataflow, region: set, inputs: set) -> None:
    """Take each 3-D input after the chain of shape-keeping elementwise maps (``GATE_MAPS``: a negation, a
    scaling, a cast) that are its only use in the region and read nothing else of it."""
    for x in [x for x in inputs if is_tensor(x) and value(x).dim() == 3]:
        while True:
            users = [u for u in flow.users[x] if u in region]
            if not (len(users) == 1 and op_name(users[0]) in GATE_MAPS and is_tensor(users[0])
                    and value(users[0]).shape == value(x).shape
                    and all(a is x or (a not in region and not is_tensor(a)) for a in users[0]._input_nodes)):
                break
            region.discard(users[0])
            inputs.discard(x)
            inputs.add(users[0])
            x = users[0]


def _leave_slices_outside(flow: Dataflow, region: set, inputs: set) -> None:
    """Take the slices of each input (``x[..., a:b]``, only slices; their bounds from outside too) as inputs."""
    for x in [x for x in inputs if is_tensor(x)]:
        for s in flow.users[x]:
            if s in region and _is_slice(s) and not any(a in region for a in s._input_nodes):
                region.discard(s)
                inputs.add(s)
        if not any(u in region for u in flow.users[x]):
            inputs.discard(x)


def _is_slice(node: fx.Node) -> bool:
    index = node.args[1] if op_name(node) == "getitem" and len(node.args) == 2 else None
    index = index if isinstance(index, tuple) else (index,)
    return is_tensor(node) and all(isinstance(i, slice) or i is Ellipsis for i in index)


#: The region boundaries ``grow`` is tried with, in this order: as grown; 3-D inputs taken after the
#: elementwise maps the region does to them alone (``-softplus(a)``: the region's g is the negation); also
#: 3-D inputs taken after a reshape to 4-D (a head split, or a chunking of the gates: which one only the proof
#: can tell); also slices of an input taken as inputs (one tensor may hold several of q, k, v: ``qkv[..., :d]``).
BOUNDARIES = (
    (),
    (_leave_gate_maps_outside,),
    (_leave_gate_maps_outside, _pull_in_head_splits),
    (_leave_slices_outside, _leave_gate_maps_outside, _pull_in_head_splits),
)


def _owned(flow: Dataflow, node: fx.Node) -> bool:
    """``_may_own(node)``, worked out once a node of the flow's graph (``grow`` runs once a boundary)."""
    if node not in flow.may_own:
        flow.may_own[node] = _may_own(node)
    return flow.may_own[node]


def _may_own(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method") or op_name(node) not in REGION_OPS:
        return False
    out = value(node)
    if op_name(node) == "getitem" and not isinstance(value(node.args[0]), torch.Tensor):
        # an element of a tuple: a token of an unbind belongs to the region, a piece of torch.split (of a
        # projection into q, k, v) is an input
        return op_name(node.args[0]) in OWNED_TUPLES
    if op_name(node) in OWNED_TUPLES:
        return True
    if not (out is None or isinstance(out, (torch.Tensor, torch.SymInt, torch.SymFloat, int, float))):
        return False
    if is_mutation(node):
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
        if is_mutation(n) and n.args[0] not in owned:
            return n
    return None
