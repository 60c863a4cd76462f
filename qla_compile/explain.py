"""``qla_compile.explain``: what the backend does to a model, for when the speedup does not show up."""
from __future__ import annotations

from dataclasses import dataclass, field

import collections

import torch

from . import dispatch
from .backend import make_backend
from .passes import frontdoor
from .passes.report import GraphReport


@dataclass
class Explanation:
    graphs: list[GraphReport]
    graph_breaks: int
    substituted: list[str] = field(default_factory=list)
    implementations: collections.Counter = field(default_factory=collections.Counter)  # (impl, why) -> calls

    @property
    def fused_calls(self) -> int:
        return sum(g.fused_calls for g in self.graphs)

    @property
    def rejected(self):
        return [r for g in self.graphs for r in g.regions if r.status != "replaced"]

    def __str__(self) -> str:
        lines = [f"qla_compile.explain: {len(self.graphs)} graph(s), {self.graph_breaks} graph break(s), "
                 f"{self.fused_calls} fused GDN call(s)"]
        lines += [g.summary() for g in self.graphs]
        if not any(g.regions or g.front_door_calls for g in self.graphs):
            lines.append("no GDN found: no known GDN function was called and no graph has an anchor (a cumsum "
                         "feeding exp of pairwise differences, or a state decayed by exp(g) token after token)")
        lines.append("dynamo substitutions active for: " + (", ".join(sorted(set(self.substituted))) or "none"))
        for (impl, why), calls in sorted(self.implementations.items()):
            lines.append(f"GDN calls run by {impl}: {calls} ({why})")
        return "\n".join(lines)


def explain(model, *example_inputs, **example_kwargs) -> Explanation:
    """Compile ``model`` with the backend (FX pass on, Inductor off) on the given inputs and report.

    Reports, per graph dynamo produced: the ``qla`` calls that came through the front door, each candidate
    region the FX pass found, whether it was replaced or rejected and why, and the time the pass took; and
    which implementation ran each GDN call (our Hopper kernels, FLA's kernels or the PyTorch reference) and why.
    The model runs once; it is compiled afresh (a new dynamo cache entry for this backend).
    """
    backend = make_backend(inductor=False)
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    ran_before = dispatch.choices()
    compiled = torch.compile(model, backend=backend)
    compiled(*example_inputs, **example_kwargs)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before
    return Explanation(backend.reports, breaks, frontdoor.registered(), dispatch.choices() - ran_before)
