"""Eager GDN implementations known by identity, each beside the substitute dynamo traces in its place.

A substitute has the original's signature and semantics and calls ``qla_compile.chunk_gated_delta_rule``
(one ``qla::chunk_gdr_fwd`` op in the graph).  Where the substitute is strictly more capable than the
original (transformers' torch path raises on ``cu_seqlens``), it takes the capable path.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..api import chunk_gated_delta_rule

TRANSFORMERS_FN = "torch_chunk_gated_delta_rule"  # the eager GDN of transformers' modeling modules
TRANSFORMERS_MODELS = "transformers.models."


def _state_in(initial_state):
    return None if initial_state is None else initial_state.to(torch.float32)


def transformers_chunk(
    query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs,
):
    """transformers' ``torch_chunk_gated_delta_rule`` (every generation): scale ``K^-0.5``, output in q's dtype."""
    o, state = chunk_gated_delta_rule(
        query, key, value, g, beta, initial_state=_state_in(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=kwargs.get("cu_seqlens"),
    )
    return o.to(query.dtype), state


def fla_chunk(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
    cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs,
):
    """FLA's ``chunk_gated_delta_rule`` (a graph break as written: it is ``torch.compiler.disable``-d)."""
    if cp_context is not None:
        raise NotImplementedError("qla_compile: FLA context parallelism (`cp_context`) is not supported")
    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
        use_gate_in_kernel=kwargs.get("use_gate_in_kernel", False), A_log=kwargs.get("A_log"),
        dt_bias=kwargs.get("dt_bias"),
    )


def fla_fused_recurrent(
    q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, **kwargs,
):
    """FLA's ``fused_recurrent_gated_delta_rule`` (what its layer runs for short inputs in eval mode)."""
    if gk is not None or gv is not None or g is None or beta is None:
        raise NotImplementedError("qla_compile: fused_recurrent_gated_delta_rule needs scalar `g` and `beta`")
    return chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
    )


def fla_naive_chunk(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None, output_final_state=False):
    """FLA's ``naive_chunk_gated_delta_rule``: float32 outputs."""
    o, state = chunk_gated_delta_rule(
        q, k, v, g, beta, scale, _state_in(initial_state), output_final_state,
    )
    return o.to(torch.float32), state


def fla_naive_recurrent(q, k, v, beta, g, scale=None, initial_state=None, output_final_state=False):
    """FLA's ``naive_recurrent_gated_delta_rule`` (note: beta before g): float32 outputs."""
    return fla_naive_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state)


@dataclass(frozen=True)
class KnownFunction:
    """One eager implementation: where it lives, and what dynamo should trace instead."""

    module: str
    attribute: str
    substitute: Callable


FLA_FUNCTIONS = (
    KnownFunction("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", fla_chunk),
    KnownFunction("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", fla_fused_recurrent),
    KnownFunction("fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule", fla_naive_chunk),
    KnownFunction("fla.ops.gated_delta_rule.naive", "naive_recurrent_gated_delta_rule", fla_naive_recurrent),
)


def defines_transformers_gdn(module) -> bool:
    """Whether ``module`` itself holds transformers' eager GDN function. Its own namespace only: a transformers
    package module is lazy, and an attribute it lacks would import its submodules (some need packages that
    are not installed)."""
    return vars(module).get(TRANSFORMERS_FN) is not None


def transformers_gdn_modules(import_all: bool) -> list[str]:
    """Names of transformers modeling modules that define ``torch_chunk_gated_delta_rule``.

    Always those already imported; with ``import_all``, also every installed ``models/*/modeling_*.py``
    whose source defines it (found by reading the files, so new model families are picked up).
    """
    names = {
        name for name, mod in list(sys.modules.items())
        if name.startswith(TRANSFORMERS_MODELS) and mod is not None
        and defines_transformers_gdn(mod)
    }
    if import_all:
        spec = importlib.util.find_spec("transformers")
        if spec is not None and spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations))) / "models"
            needle = f"def {TRANSFORMERS_FN}("
            for path in sorted(root.glob("*/modeling_*.py")):
                if needle in path.read_text(encoding="utf-8", errors="ignore"):
                    names.add(f"{TRANSFORMERS_MODELS}{path.parent.name}.{path.stem}")
    return sorted(names)


def known_functions(import_all: bool = False) -> Iterator[KnownFunction]:
    """Every known implementation that is importable now (transformers modules found at run time, FLA)."""
    for name in transformers_gdn_modules(import_all):
        yield KnownFunction(name, TRANSFORMERS_FN, transformers_chunk)
    for known in FLA_FUNCTIONS:
        if import_all or known.module in sys.modules:
            yield known
