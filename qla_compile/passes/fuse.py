"""The FX pass: find candidate GDN regions, prove each, and replace proven ones with one ``qla`` op call.

Runs on dynamo's torch-level graph, before AOTAutograd, so training differentiates through
``qla::chunk_gdr_fwd``'s registered backward.  Anything not proven stays as it was; every candidate gets a
``RegionReport`` saying what happened and why.
"""
from __future__ import annotations

import itertools
import logging
import operator
import re
import time

import torch
from torch import fx

from ..api import op_call
from ..reference import GDROptions
from .dataflow import Dataflow, written
from .prove import Binding, NotProven, prove
from .regions import BOUNDARIES, Anchor, Region, find_anchors, grow, mutates_outside, output_candidates
from .report import GraphReport, RegionReport

log = logging.getLogger(__name__)
PASS_BUDGET_SECONDS = 5.0  # per graph: proofs stop once the pass has run this long


def fused_gdn(q, k, v, g, beta, initial_state, *, head_major, state_v_first, l2norm, scale, output_head_major,
              output_dtype):
    """What a proven region becomes: layout adapters around one ``qla::chunk_gdr_fwd`` call."""
    q, k, v, g, beta = (x.transpose(1, 2) if m else x for x, m in zip((q, k, v, g, beta), head_major))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)
    opts = GDROptions(scale, l2norm, state_v_first=state_v_first)
    o, state = op_call(q, k, v, g, beta, None, None, initial_state, None, opts, torch.is_grad_enabled(), lift=True)
    o = o.to(output_dtype)
    return (o.transpose(1, 2) if output_head_major else o), state


def count_qla_calls(graph: fx.Graph) -> int:
    """Calls of our ops or of our fused-region function in ``graph``."""
    return sum(
        n.op == "call_function" and (n.target is fused_gdn or "qla" in str(n.target) or
                                     getattr(n.target, "__module__", "").startswith("qla_compile"))
        for n in graph.nodes
    )


def fuse_gdn_regions(gm: fx.GraphModule, report: GraphReport) -> None:
    """Replace every proven GDN region of ``gm`` in place; append one ``RegionReport`` per anchor. Proofs stop
    once the pass has spent ``PASS_BUDGET_SECONDS`` (the regions left are reported as such)."""
    start = time.perf_counter()
    deadline = start + PASS_BUDGET_SECONDS
    report.front_door_calls = count_qla_calls(gm.graph)
    tried_anchors: set[fx.Node] = set()
    tried_regions: set[tuple] = set()
    flow = Dataflow(gm.graph)
    pending = find_anchors(flow)
    while pending:
        anchor = pending.pop(0)
        tried_anchors.add(anchor.node)
        result = _fuse_one(gm, flow, anchor, deadline, tried_regions)
        if result is None:  # its regions were all tried from an earlier anchor
            continue
        log.info("qla_compile: region at %s: %s (%s)", result.anchor, result.status, result.reason)
        report.regions.append(result)
        if result.status == "replaced":
            flow = Dataflow(gm.graph)
            pending = [a for a in find_anchors(flow) if a.node not in tried_anchors]
    gm.graph.lint()
    gm.recompile()
    report.nodes_after = len(gm.graph.nodes)
    report.pass_seconds = time.perf_counter() - start


def _fuse_one(gm: fx.GraphModule, flow: Dataflow, anchor: Anchor, deadline: float,
              tried: set[tuple]) -> RegionReport | None:
    """Try the candidate regions of ``anchor`` not in ``tried`` (which gets them), most fused first."""
    result = RegionReport(anchor.node.name, "rejected", "", where=_where(anchor.node))
    candidates = output_candidates(flow, anchor)
    if not candidates:
        result.reason = "its flow does not end in one 4-D output (and optionally a final state)"
        return result
    new = False
    for outputs, boundary in itertools.product(candidates, BOUNDARIES):
        region = grow(flow, anchor.node, outputs, boundary)
        key = (tuple(region.outputs), tuple(region.inputs))
        if key in tried:
            continue
        tried.add(key)
        new = True
        result.nodes = len(region.nodes)
        writer = mutates_outside(region)
        if writer is not None:
            result.reason = f"{writer.name} writes into a tensor owned outside the region"
            continue
        try:
            binding = prove(gm, region, deadline)
        except NotProven as exc:
            if str(exc).startswith(NotProven.TIMEOUT):
                result.reason = str(exc)
                return result
            if not result.reason.startswith(NotProven.DIFFER):  # keep the most telling reason: a failed proof
                result.reason = str(exc)
            continue
        problem = _replace(gm, flow, region, binding)
        if problem:
            result.reason = problem
            continue
        result.status, result.reason = "replaced", _describe(region, binding)
        return result
    return result if new else None


def _replace(gm: fx.GraphModule, flow: Dataflow, region: Region, b: Binding) -> str:
    """Swap the region for a ``fused_gdn`` call; returns a reason when it cannot be placed, else ''."""
    position = min(region.outputs, key=flow.index.__getitem__)
    if any(flow.index[i] >= flow.index[position] for i in region.inputs):
        return "an input is computed after the region's output; cannot place the fused call"
    inputs = region.inputs
    args = tuple(inputs[i] for i in (b.q, b.k, b.v, b.g, b.beta)) + (
        None if b.initial_state is None else inputs[b.initial_state],)
    kwargs = dict(head_major=b.head_major, state_v_first=b.state_v_first, l2norm=b.l2norm, scale=b.scale,
                  output_head_major=b.output_head_major, output_dtype=b.output_dtype)
    graph = gm.graph
    owned = set(region.nodes)
    with graph.inserting_before(position):
        fused = graph.call_function(fused_gdn, args, kwargs)
        fused.meta.update({k: v for k, v in position.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for i, out in enumerate(region.outputs):
            old = written(out)  # a buffer filled in place: its reads after the region are outside it
            new = graph.call_function(operator.getitem, (fused, i))
            new.meta.update(old.meta)
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in owned)
    for node in reversed(region.nodes):
        _erase(graph, node)
    return ""


def _erase(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the dead code hanging off it (e.g. a final state nobody reads)."""
    if node._erased:
        return
    for user in list(node.users):
        _erase(graph, user)
    graph.erase_node(node)


def _describe(region: Region, b: Binding) -> str:
    name = [n.name for n in region.inputs]
    layout = "".join("H" if m else "T" for m in b.head_major)
    state = f", initial_state={name[b.initial_state]}" if b.initial_state is not None else ""
    final = ", final state" if len(region.outputs) > 1 else ""
    return (f"q={name[b.q]} k={name[b.k]} v={name[b.v]} g={name[b.g]} beta={name[b.beta]}{state}; "
            f"layouts {layout} (T: token-major, H: head-major), l2norm={b.l2norm}, scale={b.scale:.6g}{final}")


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace)
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f"{fn} ({path.rsplit('/', 1)[-1]}:{line})"

