"""Our kernels behind FLA's ``chunk_gated_delta_rule``, eagerly, through FLA's backend registry (``fla.backends``).

FLA (>= 0.6) sends each call of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` to the first registered
backend, lowest ``priority`` first, whose verifier accepts it, and otherwise to its own Triton kernels; FLA's
``GatedDeltaNet`` layer and transformers' Qwen3-Next / Qwen3.5 models (which bind FLA's op when FLA is installed)
all call it. :mod:`.fla_backend` registers ``QlaCompileBackend`` at priority 2, ahead of FlashQLA (3): it takes
what our Hopper kernels serve and declines the rest with a reason, which FLA logs once.

It is in place as soon as both packages are imported, in either order, and ``import qla_compile`` never imports
FLA: :func:`install` registers at once when ``fla.backends`` is already imported, else a finder on
``sys.meta_path`` registers right after FLA imports it. ``FLA_QLA_COMPILE=0`` turns the backend off (FLA's
convention, as ``FLA_FLASH_QLA=0`` does for FlashQLA).
"""
from __future__ import annotations

from ..import_hooks import when_imported

WATCHED = "fla.backends"


def install() -> None:
    """Register the backend now if FLA's registry is imported, else once it is."""
    when_imported(WATCHED, _register)


def _register() -> None:
    from . import fla_backend

    fla_backend.register()
