"""qla_compile: fast Gated DeltaNet (``chunk_gated_delta_rule``) for PyTorch, eager and under torch.compile."""
from . import ops  # noqa: F401  (registers the qla:: custom ops)
from .api import chunk_gated_delta_rule
from .backend import backend, make_backend
from .explain import explain
from .passes.frontdoor import register_substitutions
from .reference import recurrent_gdr_reference

__all__ = [
    "backend", "chunk_gated_delta_rule", "explain", "make_backend", "recurrent_gdr_reference", "register_substitutions",
]
__version__ = "0.1.0"
