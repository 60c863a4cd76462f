"""Dataflow over a dynamo FX graph with in-place writes made explicit.

Dynamo keeps ``x[i] = y`` as an ``operator.setitem`` node with no users, and later reads of ``x`` use ``x``'s
own node.  Here a mutation of ``x`` becomes a virtual edge to every later user of ``x``, so that
"what flows where" (users, post-dominators) sees through in-place writes.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from ..patterns.graph_anchors import MUTATING


def op_name(node: fx.Node) -> str:
    """``__name__`` of a call_function target, or the method name of a call_method node ('' otherwise)."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return ""


def value(node) -> object:
    """The example value dynamo recorded for ``node`` (a FakeTensor, SymInt, ...), or None."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def is_tensor(node) -> bool:
    return isinstance(value(node), torch.Tensor)


def node_args(node: fx.Node) -> list[fx.Node]:
    return list(node._input_nodes)


class Dataflow:
    """Users and arguments of each node, with mutation edges, plus post-dominators towards the graph output."""

    def __init__(self, graph: fx.Graph):
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.users: dict[fx.Node, list[fx.Node]] = {n: list(n.users) for n in self.nodes}
        self.args: dict[fx.Node, list[fx.Node]] = {n: node_args(n) for n in self.nodes}
        writes: dict[fx.Node, list[fx.Node]] = defaultdict(list)  # target -> mutating nodes, in order
        for n in self.nodes:
            if op_name(n) in MUTATING and n.args and isinstance(n.args[0], fx.Node):
                writes[n.args[0]].append(n)
        for target, muts in writes.items():
            for m in muts:
                for reader in target.users:
                    if reader is not m and self.index[reader] > self.index[m]:
                        self.users[m].append(reader)
                        self.args[reader].append(m)
        self.sink = next(n for n in reversed(self.nodes) if n.op == "output")
        self.dead = self._dead_nodes()
        for n in self.nodes:
            self.users[n] = [u for u in self.users[n] if u not in self.dead]

    def _dead_nodes(self) -> set[fx.Node]:
        """Nodes whose value reaches neither the output nor a write into a graph input (e.g. an unused state)."""
        dead: set[fx.Node] = set()
        for n in reversed(self.nodes):
            if n is self.sink or n.op in ("placeholder", "get_attr"):
                continue
            if op_name(n) in MUTATING and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder":
                continue
            if n.op in ("call_function", "call_method") and all(u in dead for u in self.users[n]):
                dead.add(n)
        return dead

    def post_dominators(self, ignore=frozenset()) -> dict[fx.Node, fx.Node | None]:
        """Immediate post-dominator of every node (towards the graph output), paths into ``ignore`` left out."""
        ipdom: dict[fx.Node, fx.Node | None] = {self.sink: None}
        depth = {self.sink: 0}

        def meet(a, b):
            while a is not b:
                if depth[a] < depth[b]:
                    a, b = b, a
                a = ipdom[a]
            return a

        for n in reversed(self.nodes):
            if n is self.sink:
                continue
            users = [u for u in self.users[n] if u in depth and u not in ignore]
            if not users:
                ipdom[n], depth[n] = self.sink, 1
                continue
            p = users[0]
            for u in users[1:]:
                p = meet(p, u)
            ipdom[n], depth[n] = p, depth[p] + 1
        return ipdom

    def covered_by(self, outputs) -> set[fx.Node]:
        """Nodes all of whose flow ends in ``outputs`` (they can be removed once the outputs are replaced)."""
        outputs = set(outputs)
        covered: set[fx.Node] = set()
        for n in reversed(self.nodes):
            if n in outputs:
                covered.add(n)
            elif self.users[n] and all(u in covered for u in self.users[n]):
                covered.add(n)
        return covered

    def descendants(self, node: fx.Node) -> set[fx.Node]:
        seen, stack = set(), [node]
        while stack:
            for u in self.users[stack.pop()]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return seen
