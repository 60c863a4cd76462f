"""Compilation glue: the sm_90a target, the key of a kernel variant and where its binary comes from.

Host code reaches a kernel through :func:`kernel` (or a :class:`Kernels` handle of its module), which loads the
variant's prebuilt ``executable.so`` straight into TVM-FFI when the prebuilt manifest vouches for it
(``_prebuilt.listed_key``: the installed kernel sources and TileLang are those it was built from): no TileLang
import, no TIR. Otherwise, with one log line saying why, it imports the kernel module and calls its factory.

A factory ``f(**params) -> PrimFunc`` wrapped by :func:`compiled` becomes ``f(**params) -> JITKernel``, taken
from the first of

1. the prebuilt binaries installed with the package (:mod:`._prebuilt`; ``QLA_PREBUILT=0`` skips them);
2. the kernel cache ``$QLA_CACHE_DIR/kernels`` (default ``~/.cache/qla_compile``), which step 3 fills;
3. a JIT compile by TileLang, logged in one line that says why steps 1 and 2 had no binary.

Steps 1 and 2 hold a variant under its key (:func:`variant_key`): a hash of the TIR its factory generates (so of
every kernel source it depends on), its name and params (with the factory's defaults filled in, :func:`full_params`:
a call that spells a default out finds the same binary as one that leaves it out), the TileLang version, the target
and the pass configs.
A changed kernel or TileLang has other keys, so a stale binary is never found, let alone loaded. An entry is a
directory (:func:`save`): ``executable.so`` (the host launcher with the sm_90a cubin, TileLang's tvm_ffi
backend), ``params.json`` (the argument types) and ``device_kernel.cu`` (the generated CUDA, for reading).

Every kernel is compiled for the explicit target ``{"kind": "cuda", "arch": "sm_90a"}``, so that binaries built on
a CPU-only machine with nvcc (``python -m qla_compile.prebuild``) load on the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import platform
import shutil
import tempfile
import threading

from . import _prebuilt

TARGET = {"kind": "cuda", "arch": "sm_90a"}
_BACKEND = "tvm_ffi"
_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def cache_dir() -> str:
    """The on-disk kernel cache directory (``$QLA_CACHE_DIR`` or ``~/.cache/qla_compile``)."""
    return os.environ.get("QLA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qla_compile")


def pass_configs() -> dict:
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH.value: False}


def variant_key(name: str, params: dict, prim) -> str:
    """The key of kernel ``name`` built with ``params`` into the PrimFunc ``prim``."""
    import tilelang

    data = {
        "kernel": name,
        "params": params,
        "tir": hashlib.sha256(prim.script(show_meta=True).encode()).hexdigest(),
        "tilelang": tilelang.__version__,
        "target": TARGET,
        "pass_configs": pass_configs(),
        "backend": _BACKEND,
        "machine": platform.machine(),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def defaults(factory) -> dict:
    """The defaults of a kernel factory's params."""
    return {n: p.default for n, p in inspect.signature(factory).parameters.items() if p.default is not p.empty}


def full_params(factory, params: dict) -> dict:
    """``params`` with ``factory``'s defaults filled in, in its signature's order (an unknown one is kept, for the
    factory to reject)."""
    sig = inspect.signature(factory).parameters
    full = {n: params.get(n, p.default) for n, p in sig.items() if n in params or p.default is not p.empty}
    return {**full, **{n: v for n, v in params.items() if n not in sig}}


def describe(name: str, params: dict) -> str:
    """``name(k=v, ...)``, as the log and ``prebuild`` name a variant."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


def load(entry: str, prim):
    """The kernel saved in the directory ``entry`` (:func:`save`); ``prim`` is its PrimFunc."""
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource

    with open(os.path.join(entry, "params.json")) as f:
        params = load_kernel_params(f.read())
    return JITKernel.from_database(
        func=prim, host_kernel_source=CachedTextSource(),
        device_kernel_source=CachedTextSource(path=os.path.join(entry, "device_kernel.cu")),
        kernel_lib_path=os.path.join(entry, "executable.so"), params=params, target=TARGET, target_host=None,
        out_idx=None, execution_backend=_BACKEND, pass_configs=pass_configs(),
    )


def save(kernel, entry: str):
    """Write a compiled ``kernel`` to the directory ``entry``, whole or not at all (it is renamed into place;
    an entry another process wrote first is kept)."""
    from tilelang.engine.param import dump_kernel_params

    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        kernel.adapter.get_exportable_executable().export_library(os.path.join(staging, "executable.so"))
        with open(os.path.join(staging, "params.json"), "w") as f:
            f.write(dump_kernel_params(kernel.params))
        with open(os.path.join(staging, "device_kernel.cu"), "w") as f:
            f.write(kernel.kernel_source)
        try:
            os.rename(staging, entry)
        except OSError:
            if not os.path.isdir(entry):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _tilelang_cache_off():
    """TileLang's own kernel cache off for our compiles: ours holds the binaries (it would keep a second copy)."""
    from tilelang import env

    enabled = env.is_cache_enabled()
    env.disable_cache()
    try:
        yield
    finally:
        if enabled:
            env.enable_cache()


def _jit(name, params, prim, key, why):
    """``prim`` compiled by TileLang (logged once, with ``why`` it was not found) and saved under ``key``."""
    import tilelang

    entry = os.path.join(cache_dir(), "kernels", key)
    log.warning("qla_compile: compiling the kernel %s for sm_90a (%s); it goes to %s", describe(name, params), why,
                entry)
    with _tilelang_cache_off():
        kernel = tilelang.compile(prim, target=TARGET, execution_backend=_BACKEND, pass_configs=pass_configs())
    try:
        save(kernel, entry)
    except OSError as exc:
        log.warning("qla_compile: could not save the kernel to %s (%s)", entry, exc)
    return kernel


def _find(name, params, prim, key):
    """``(kernel, None)`` from the prebuilt binaries or the kernel cache, else ``(None, why neither had it)``."""
    why = "prebuilt binaries are off (QLA_PREBUILT=0)" if os.environ.get("QLA_PREBUILT") == "0" else \
        _prebuilt.why_not(key, name, params)
    if why is None:
        try:
            return load(_prebuilt.entry(key, cache_dir()), prim), None
        except Exception as exc:  # noqa: BLE001  (any failure to load means: compile it)
            why = f"its prebuilt binary did not load: {exc}"
    entry = os.path.join(cache_dir(), "kernels", key)
    if not os.path.isdir(entry):
        return None, f"{why}; not in the kernel cache either"
    try:
        return load(entry, prim), None
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(entry, ignore_errors=True)  # a broken entry: the compile below writes it again
        return None, f"{why}; its cached binary did not load: {exc}"


def compiled(factory):
    """Memoise a kernel factory ``f(**params) -> PrimFunc`` into ``f(**params) -> JITKernel`` (see the module
    docstring); ``f.key(**params)`` is the variant's key, computed without compiling."""
    name = factory.__name__

    @functools.lru_cache(maxsize=None)
    def build(**params):
        params = full_params(factory, params)
        with _LOCK:
            prim = factory(**params)
            key = variant_key(name, params, prim)
            kernel, why = _find(name, params, prim, key)
            return kernel if kernel is not None else _jit(name, params, prim, key, why)

    build.factory = factory

    def key(**params):
        params = full_params(factory, params)
        return variant_key(name, params, factory(**params))

    build.key = key
    return build


@functools.cache
def _tvm_ffi():
    """``tvm_ffi``, with TileLang's runtime libraries loaded globally but TileLang not imported: libtvm_runtime.so
    registers TVM's CUDA module loader (for the cubin inside each ``executable.so``), libtilelang.so the TMA
    descriptor builder (``__tvm_tensormap_create_tiled``) that most kernels' host code calls."""
    lib = os.path.join(os.path.dirname(importlib.util.find_spec("tilelang").origin), "lib")
    for name in ("libtvm_runtime.so", "libtilelang.so"):
        ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL)
    import tvm_ffi

    return tvm_ffi


def load_direct(module: str, name: str, params: dict):
    """``(callable, None)``: the prebuilt binary of the variant loaded straight into TVM-FFI, its entry function
    (what TileLang's tvm_ffi adapter calls for a kernel that takes its outputs preallocated, as all of ours do),
    else ``(None, why not)``."""
    key, why = _prebuilt.listed_key(f"{__package__}.{module}", name, params)
    if why is not None:
        return None, why
    try:
        return _tvm_ffi().load_module(os.path.join(_prebuilt.entry(key, cache_dir()), "executable.so")).main, None
    except Exception as exc:  # noqa: BLE001  (any failure to load means: the slow path)
        return None, f"its prebuilt binary did not load directly: {exc}"


@functools.lru_cache(maxsize=None)
def kernel(module: str, name: str, **params):
    """The kernel ``name`` of the kernel module ``module`` (``"kkt_inverse"``, ...) built with ``params``, as a
    callable of its arguments: the prebuilt binary loaded directly (see the module docstring; not with
    ``QLA_PREBUILT=0``), else the module's :func:`compiled` factory."""
    if os.environ.get("QLA_PREBUILT") != "0":
        with _LOCK:
            fn, why = load_direct(module, name, params)
        if fn is not None:
            return fn
        log.warning("qla_compile: the kernel %s is not loaded straight from its prebuilt binary (%s); TileLang "
                    "looks it up by its TIR", describe(name, params), why)
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)(**params)


class Kernels:
    """The kernels of the kernel module ``module`` by attribute, each through :func:`kernel` (the module itself is
    imported only when that needs it): ``Kernels("kkt_inverse").kkt_inverse(dk=128, dtype="bfloat16")``."""

    def __init__(self, module: str):
        self.module = module

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        launcher = functools.partial(kernel, self.module, name)
        setattr(self, name, launcher)
        return launcher
