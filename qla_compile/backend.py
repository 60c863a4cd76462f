"""The torch.compile backend: ``torch.compile(model, backend=qla_compile.backend)``.

Before every compiled call it registers dynamo substitutions for the known eager GDN functions
(``passes/frontdoor.py``; global to the process, idempotent), so they trace as one ``qla`` op.  On each graph
dynamo hands over, it runs the FX pass (``passes/fuse.py``) that proves and fuses GDN written in any other
way, then compiles with Inductor.  The replacement happens on the torch-level graph, before AOTAutograd,
so training uses the ``qla`` backward op.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from torch import fx

from .passes import frontdoor
from .passes.fuse import fuse_gdn_regions
from .passes.report import GraphReport

log = logging.getLogger(__name__)


class QlaBackend:
    """A torch.compile backend; build variants with ``make_backend``.

    Attributes:
        reports: one ``GraphReport`` per graph compiled by this backend object (regions found, replaced or
            rejected and why, time spent in the pass and in the whole compile).
    """

    def __init__(self, inductor: bool = True, mode: str | None = None, options: dict[str, Any] | None = None,
                 fx_pass: bool = True):
        self.inductor = inductor
        self.mode = mode
        self.options = dict(options or {})
        self.fx_pass = fx_pass
        self.reports: list[GraphReport] = []
        # dynamo enters this before every call of the compiled function, i.e. before it traces anything
        self.backend_ctx_ctor = _front_door_context

    def __call__(self, gm: fx.GraphModule, example_inputs):
        start = time.perf_counter()
        report = GraphReport(index=len(self.reports), nodes_before=len(gm.graph.nodes))
        self.reports.append(report)
        if self.fx_pass:
            fuse_gdn_regions(gm, report)
        else:
            report.nodes_after = report.nodes_before
        compiled = self._compile(gm, example_inputs)
        report.compile_seconds = time.perf_counter() - start
        log.info("qla_compile: %s", report.summary())
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs):
        if not self.inductor:
            return gm.forward
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = {**list_mode_options(self.mode), **self.options}
        return compile_fx(gm, example_inputs, config_patches=patches or None)

    def __repr__(self) -> str:
        return f"QlaBackend(inductor={self.inductor}, mode={self.mode!r}, options={self.options})"


@contextlib.contextmanager
def _front_door_context():
    frontdoor.refresh()
    yield


def make_backend(inductor: bool = True, mode: str | None = None, options: dict[str, Any] | None = None,
                 fx_pass: bool = True) -> QlaBackend:
    """A backend with options.

    Args:
        inductor: compile the rewritten graph with Inductor (False runs it eagerly: for debugging).
        mode, options: Inductor's ``torch.compile(mode=..., options=...)``, which a custom backend does not
            receive from ``torch.compile`` itself.
        fx_pass: run the FX pass (the front-door substitutions are always active).
    """
    return QlaBackend(inductor=inductor, mode=mode, options=options, fx_pass=fx_pass)


backend = make_backend()
