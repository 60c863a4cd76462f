"""``QlaCompileBackend``: FLA's ``chunk_gated_delta_rule`` on our Hopper kernels (see :mod:`.fla`). Imports FLA."""
from __future__ import annotations

from fla.backends import BaseBackend
from fla.backends import register as fla_register

from .. import dispatch
from ..patterns.known_functions import fla_chunk

ENV_VAR = "FLA_QLA_COMPILE"
_OPTIONS = {"use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"}  # FLA's keyword-only options we take


class QlaCompileBackend(BaseBackend):
    """qla_compile's fused TileLang kernels (SM90, bf16/fp16, K = V = 128, every option of FLA's layers).

    Declines other GPUs, dtypes and head dims, CPU tensors and FLA's inter-card context parallelism
    (``cp_context``), so those calls go on to FLA's next backend or its Triton kernels. Off with
    ``FLA_QLA_COMPILE=0``.
    """

    backend_type = "qla_compile"
    package_name = "qla_compile"
    env_var = ENV_VAR
    default_enable = True
    priority = 2

    def chunk_gated_delta_rule_verifier(self, q, k, v, g, beta, scale=None, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False,
                                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                        state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                        chunk_indices=None, cp_context=None, **kwargs):
        if cp_context is not None:
            return False, "qla_compile does not take FLA's inter-card context parallelism (cp_context)"
        unknown = sorted(set(kwargs) - _OPTIONS)
        if unknown:
            return False, f"qla_compile does not take the options {unknown}"
        if kwargs.get("chunk_size", 64) not in (16, 32, 64):
            return False, f"qla_compile takes chunk_size 16, 32 or 64, got {kwargs['chunk_size']}"
        impl, why = dispatch.choose(q, k, v)
        if impl != "hopper":
            return False, f"qla_compile: {why.split(';')[0]}"
        return True, None

    chunk_gated_delta_rule = staticmethod(fla_chunk)


def register() -> None:
    """Register (or re-register: FLA keys backends by type) with FLA's ``gated_delta_rule`` registry."""
    fla_register("gated_delta_rule")(QlaCompileBackend)
