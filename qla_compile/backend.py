"""The torch.compile backend: ``torch.compile(model, backend=qla_compile.backend)``.

Four mechanisms, all before AOTAutograd, so that training differentiates through the ``qla`` backward op and
through what the rewrites leave:

* **Front door** (``passes/frontdoor.py``): dynamo substitutions for the known eager GDN functions, so they
  trace as one ``qla`` op with a dynamic length.  Registration is global to the process and idempotent;
  each function is registered as its module is imported (``frontdoor.install``), whatever the backend.  A
  function the front door does not know (remote code, a fork) is fused by the FX pass.
* **FX pass** (``passes/fuse.py``): on each graph dynamo hands over, proves and fuses GDN written any other
  way.
* **Short convolutions** (``passes/short_conv.py``): depthwise ``conv1d`` calls (the GDN layer's causal
  convolution in transformers' models) become shifted multiply-adds that Inductor fuses.
* **Causal masks** (``passes/causal_mask.py``): attention on a materialised mask that is provably the causal
  one (what transformers builds while tracing) becomes ``is_causal=True`` attention, as it runs eagerly.

Then Inductor compiles the result (with ``inductor_compat``'s fixes for dynamic shapes).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import fx

from .inductor_compat import dynamic_config, dynamic_shape_fixes
from .passes.causal_mask import drop_causal_masks
from .passes.fuse import fuse_gdn_regions
from .passes.report import GraphReport
from .passes.short_conv import rewrite_short_convs

log = logging.getLogger(__name__)


class QlaBackend:
    """A torch.compile backend; build variants with ``make_backend``.

    ``torch.compile(model, backend=b, mode=..., options=...)`` also works: torch.compile hands its Inductor
    mode and options to the backend, and they override the backend's own.

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

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict[str, Any] | None = None):
        start = time.perf_counter()
        report = GraphReport(index=len(self.reports), nodes_before=len(gm.graph.nodes))
        self.reports.append(report)
        if self.fx_pass:
            fuse_gdn_regions(gm, report)
        else:
            report.nodes_after = report.nodes_before
        report.short_convs = rewrite_short_convs(gm)
        report.causal_masks = drop_causal_masks(gm, report.masks_kept)
        compiled = self._compile(gm, example_inputs, mode or self.mode, {**self.options, **(options or {})})
        report.compile_seconds = time.perf_counter() - start
        log.info("qla_compile: %s", report.summary())
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs, mode, options):
        if not self.inductor:  # AOTAutograd with eager kernels: the same graph rewrite, no Inductor codegen
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = {**dynamic_config(example_inputs), **list_mode_options(mode or "default"), **options}
        with dynamic_shape_fixes():  # the backward graph compiles here too, ahead of time
            return compile_fx(gm, example_inputs, config_patches=patches or None)

    def __repr__(self) -> str:
        return (f"QlaBackend(inductor={self.inductor}, mode={self.mode!r}, options={self.options}, "
                f"fx_pass={self.fx_pass})")


def make_backend(inductor: bool = True, mode: str | None = None, options: dict[str, Any] | None = None,
                 fx_pass: bool = True) -> QlaBackend:
    """A backend with options.

    Args:
        inductor: compile the rewritten graph with Inductor (False: AOTAutograd with eager kernels, for
            debugging and quick compiles).
        mode, options: Inductor's ``torch.compile(mode=..., options=...)``, which a custom backend does not
            receive from ``torch.compile`` itself.
        fx_pass: run the FX pass that proves and fuses GDN regions. (The front door's substitutions of known GDN
            functions are registered as their modules import, for every backend: ``qla_compile.frontdoor``.)
    """
    return QlaBackend(inductor=inductor, mode=mode, options=options, fx_pass=fx_pass)


backend = make_backend()
