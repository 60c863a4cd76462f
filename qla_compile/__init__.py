"""qla_compile: fast Gated DeltaNet (``chunk_gated_delta_rule``) for PyTorch, eager and under torch.compile."""
from . import ops  # noqa: F401  (registers the qla:: custom ops)
from .api import chunk_gated_delta_rule
from .backend import backend, make_backend
from .explain import explain
from .integrations import fla as _fla
from .integrations.transformers import apply_to_transformers, revert_transformers
from .passes import frontdoor as _frontdoor
from .passes.frontdoor import register_substitutions
from .reference import recurrent_gdr_reference

_fla.install()  # our backend in FLA's registry, now or once FLA is imported (FLA itself is not imported here)
_frontdoor.install()  # dynamo substitutions, registered as FLA's and transformers' GDN modules are imported

__all__ = [
    "apply_to_transformers", "backend", "chunk_gated_delta_rule", "explain", "make_backend", "recurrent_gdr_reference",
    "register_substitutions", "revert_transformers",
]
__version__ = "0.1.0"
