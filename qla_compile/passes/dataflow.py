"""Dataflow over a dynamo FX graph with in-place writes made explicit.

Dynamo keeps ``x[i] = y`` as an ``operator.setitem`` node with no users, and later reads of ``x`` use ``x``'s
own node.  Here each read of ``x`` reads the last write before it instead (the writes form a chain from ``x``),
so that "what flows where" (users, post-dominators) sees through in-place writes, and a write stands for the
tensor it leaves behind (:func:`written`): a buffer filled in place and then returned ends in its last write.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from ..patterns.graph_anchors import MUTATING


def op_name(node: fx.Node) -> str:
    """``__name__`` of a call_function target, or the method name of a call_method node ('' otherwise); an
    operator method by its ``operator`` function's name (dynamo may record ``x == 1`` as either)."""
    if node.op == "call_method":
        return _OPERATOR_METHODS.get(node.target, node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return ""


_OPERATOR_METHODS = {f"__{name.rstrip('_')}__": name for name in (
    "eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "invert",
    "and_", "or_", "xor", "getitem", "matmul")}


def value(node) -> object:
    """The example value dynamo recorded for ``node`` (a FakeTensor, SymInt, ...), or None."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def is_tensor(node) -> bool:
    return isinstance(value(node), torch.Tensor)


def node_args(node: fx.Node) -> list[fx.Node]:
    return list(node._input_nodes)


def is_mutation(node: fx.Node) -> bool:
    return op_name(node) in MUTATING and bool(node.args) and isinstance(node.args[0], fx.Node)


def written(node: fx.Node) -> fx.Node:
    """The tensor a write leaves its result in (its target), or ``node`` itself."""
    return node.args[0] if is_mutation(node) else node


class Dataflow:
    """Users and arguments of each node, reads after a write rerouted to that write, plus post-dominators towards
    the graph output."""

    def __init__(self, graph: fx.Graph):
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.users: dict[fx.Node, list[fx.Node]] = {n: list(n.users) for n in self.nodes}
        self.args: dict[fx.Node, list[fx.Node]] = {n: node_args(n) for n in self.nodes}
        writes: dict[fx.Node, list[fx.Node]] = defaultdict(list)  # target -> mutating nodes, in order
        for n in self.nodes:
            if is_mutation(n):
                writes[n.args[0]].append(n)
        for target, muts in writes.items():
            for reader in target.users:
                last = next((m for m in reversed(muts) if self.index[m] < self.index[reader]), None)
                if last is not None:
                    self.users[target].remove(reader)
                    self.args[reader].remove(target)
                    self.users[last].append(reader)
                    self.args[reader].append(last)
        self._pdom: tuple | None = None
        self.may_own: dict[fx.Node, bool] = {}  # ``regions.grow``'s answers for this graph, asked once a node
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
            if is_mutation(n) and n.args[0].op == "placeholder":
                continue
            if n.op in ("call_function", "call_method") and all(u in dead for u in self.users[n]):
                dead.add(n)
        return dead

    def post_dominator(self, nodes, ignore=frozenset()) -> fx.Node:
        """The first node that all flow from ``nodes`` passes through (for one node, its immediate
        post-dominator; the sink at worst), paths into ``ignore`` left out."""
        if ignore:
            ipdom, depth = self._post_dominator_tree(ignore)
        else:  # the common case, cached
            self._pdom = self._pdom or self._post_dominator_tree(ignore)
            ipdom, depth = self._pdom
        nodes = list(nodes)
        p = ipdom[nodes[0]]
        for n in nodes[1:]:
            p = _meet(ipdom, depth, p, ipdom[n])
        return p

    def _post_dominator_tree(self, ignore) -> tuple[dict, dict]:
        """Immediate post-dominator of every node towards the graph output, and its depth in that tree."""
        ipdom: dict[fx.Node, fx.Node | None] = {self.sink: self.sink}
        depth = {self.sink: 0}
        for n in reversed(self.nodes):
            if n is self.sink:
                continue
            users = [u for u in self.users[n] if u in depth and u not in ignore]
            if not users:
                ipdom[n], depth[n] = self.sink, 1
                continue
            p = users[0]
            for u in users[1:]:
                p = _meet(ipdom, depth, p, u)
            ipdom[n], depth[n] = p, depth[p] + 1
        return ipdom, depth

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

    def descendants(self, nodes) -> set[fx.Node]:
        seen, stack = set(), list(nodes)
        while stack:
            for u in self.users[stack.pop()]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return seen


def _meet(ipdom: dict, depth: dict, a: fx.Node, b: fx.Node) -> fx.Node:
    """The nearest common ancestor of ``a`` and ``b`` in the post-dominator tree."""
    while a is not b:
        if depth[a] < depth[b]:
            a, b = b, a
        a = ipdom[a]
    return a
