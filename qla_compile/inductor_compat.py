"""Work around Inductor behaviour that pins the sequence length of GDN models, scoped to our compiles.

A dynamic length must survive the training compile: the forward, and the backward that AOTAutograd compiles
ahead of time when shapes are dynamic.  Two places in torch 2.13 turn it into a constant (so each new length
compiled a new graph), and ``dynamic_shape_fixes()`` undoes both while our backend runs ``compile_fx``:

* **Saved-activation strides.**  Inductor reports the strides of the forward's outputs to AOTAutograd
  evaluated at the example sizes (plain ints); where one differs from the traced stride (e.g. a size-1 dim of
  the ``[B,1,T,T]`` attention mask saved for SDPA's backward), the backward's placeholder is re-strided with
  those ints, which guards T to the example length.  We have Inductor report them as symbolic expressions
  (its ``fakify_first_call`` branch, the form upstream PyTorch later made the default).
* **Backward convolutions (torch >= 2.12).**  Inductor's own ``aten.convolution_backward`` lowering makes
  every stride of the gradient a guarded int to choose a stride order, pinning T of the short causal conv1d
  in front of every GDN layer.  Backward convolutions with symbolic sizes take the ATen kernel instead, as
  on torch <= 2.11; static ones keep Inductor's lowering.

A third, ``dynamic_config()``, is an Inductor option for graphs with symbolic sizes:

* **No layout optimisation.**  On CPU with oneDNN, Inductor enables it for any graph with a convolution,
  symbolic sizes or not, then fails choosing a channels-last order for a 4-D tensor with a symbolic size
  (``cannot determine truth value of Relational``), e.g. the q/k/v of a batch-1 GDN layer.  It only
  reorders 4-D conv2d activations, which GDN models do not have.

Each fix checks that the torch internals it relies on exist and otherwise leaves torch alone.
"""
from __future__ import annotations

import contextlib
import importlib

import torch


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@contextlib.contextmanager
def _symbolic_output_strides():
    output_code = _module("torch._inductor.output_code")
    report = getattr(output_code, "set_tracing_context_output_strides", None)
    if report is None:
        yield
        return

    def symbolic_report(example_inputs, compiled_graph):
        context = torch._guards.TracingContext.try_get()
        if context is None or not hasattr(context, "fakify_first_call"):
            return report(example_inputs, compiled_graph)
        before, context.fakify_first_call = context.fakify_first_call, True
        try:
            return report(example_inputs, compiled_graph)
        finally:
            context.fakify_first_call = before

    output_code.set_tracing_context_output_strides = symbolic_report
    try:
        yield
    finally:
        output_code.set_tracing_context_output_strides = report


@contextlib.contextmanager
def _dynamic_conv_backward_fallback():
    lowering, conv = _module("torch._inductor.lowering"), _module("torch._inductor.kernel.conv")
    table = getattr(lowering, "lowerings", None)
    fallback = getattr(conv, "aten_convolution_backward_fallback", None)
    key = torch.ops.aten.convolution_backward.default
    if not isinstance(table, dict) or fallback is None or key not in table:
        yield
        return
    from torch._inductor.utils import is_dynamic

    inductor_lowering = table[key]

    def lowering_fn(grad_out, input, weight, *args, **kwargs):
        chosen = fallback if is_dynamic(grad_out, input, weight) else inductor_lowering
        return chosen(grad_out, input, weight, *args, **kwargs)

    table[key] = lowering_fn
    try:
        yield
    finally:
        table[key] = inductor_lowering


def dynamic_config(example_inputs) -> dict:
    """Inductor options for a graph compiled for ``example_inputs`` (see the module docstring)."""
    symbolic = any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and not all(
        isinstance(s, int) for s in x.shape)) for x in example_inputs)
    return {"layout_optimization": False} if symbolic else {}


@contextlib.contextmanager
def dynamic_shape_fixes():
    """Within this context, Inductor compiles keep a dynamic length dynamic (see the module docstring)."""
    with _symbolic_output_strides(), _dynamic_conv_backward_fallback():
        yield
