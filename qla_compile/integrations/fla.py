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

import importlib.abc
import importlib.util
import sys

WATCHED = "fla.backends"


def install() -> None:
    """Register the backend now if FLA's registry is imported, else once it is."""
    if WATCHED in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _register() -> None:
    from . import fla_backend

    fla_backend.register()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``fla.backends`` through the other finders and registers our backend once it has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != WATCHED:
            return None
        sys.meta_path.remove(self)  # once, and not in the way of the real search below
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    """A module's own loader, then :func:`_register`."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_source, get_filename, ... as the module's own loader answers them
        return getattr(self._loader, name)
