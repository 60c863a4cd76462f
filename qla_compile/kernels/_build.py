"""Compilation glue: the sm_90a target, the on-disk kernel cache and one compile per variant.

Every kernel is compiled for the explicit target ``{"kind": "cuda", "arch": "sm_90a"}`` so that a
cache built on a CPU-only machine (``python -m qla_compile.prebuild``) is hit on the GPU machine.
The cache lives in ``$QLA_CACHE_DIR`` (default ``~/.cache/qla_compile``); TileLang's own
``TILELANG_CACHE_DIR`` is pointed there while our kernels compile or load, then restored.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

TARGET = {"kind": "cuda", "arch": "sm_90a"}
_LOCK = threading.Lock()


def cache_dir() -> str:
    """The on-disk kernel cache directory (``$QLA_CACHE_DIR`` or ``~/.cache/qla_compile``)."""
    return os.environ.get("QLA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qla_compile")


@contextlib.contextmanager
def _our_cache():
    from tilelang import env

    descriptor = type(env).__dict__["TILELANG_CACHE_DIR"]
    previous = descriptor._forced_value
    with _LOCK:
        env.TILELANG_CACHE_DIR = cache_dir()
        try:
            yield
        finally:
            descriptor._forced_value = previous


def pass_configs() -> dict:
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}


def compiled(factory):
    """Memoise a kernel factory ``f(**params) -> PrimFunc`` into ``f(**params) -> JITKernel``."""

    @functools.lru_cache(maxsize=None)
    def build(**params):
        import tilelang

        with _our_cache():
            return tilelang.compile(factory(**params), target=TARGET, pass_configs=pass_configs())

    build.factory = factory
    return build
