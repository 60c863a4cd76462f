"""qla_compile: fast Gated DeltaNet (``chunk_gated_delta_rule``) for PyTorch, eager and under torch.compile."""
from . import ops  # noqa: F401  (registers the qla:: custom ops)
from .api import chunk_gated_delta_rule
from .reference import recurrent_gdr_reference

__all__ = ["chunk_gated_delta_rule", "recurrent_gdr_reference"]
__version__ = "0.1.0"
