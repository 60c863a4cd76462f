"""Front door: dynamo substitutions (``torch.compiler.substitute_in_graph``) for the known eager GDN functions.

With a substitution registered, dynamo traces one ``qla::chunk_gdr_fwd`` call where it would have unrolled
the chunk loop (a recompile per number of chunks) or broken the graph (FLA's ``torch.compiler.disable``).
Eager calls are unaffected: a substitution only applies while dynamo traces.

Registration is **global to the process** and idempotent.  It is keyed by object identity, so it must see
the objects the layers really call: a transformers layer looks its module-level function up at call time,
and that name is bound to the ``use_kernel_func_from_hub_with_fallback`` wrapper, so we register the wrapper
and every function below it along ``__wrapped__``.  Modules imported after a registration are picked up by
the next ``register_substitutions()`` call, which ``qla_compile.backend`` makes before every compiled call.
"""
from __future__ import annotations

import importlib
import logging
import sys
import threading

import torch

from ..patterns.known_functions import known_functions

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registered: dict[int, tuple[object, str]] = {}  # id(original) -> (original kept alive, "module.attribute")
_modules_seen = -1


def _unwrap_chain(fn):
    """``fn`` and each function reachable from it through ``__wrapped__``."""
    while fn is not None:
        yield fn
        fn = getattr(fn, "__wrapped__", None)


def register_substitutions(import_all: bool = False) -> list[str]:
    """Register dynamo substitutions for every known eager GDN implementation importable now.

    Args:
        import_all: also import every installed transformers modeling module that defines
            ``torch_chunk_gated_delta_rule``, and FLA's modules (a second or so); by default only modules
            already imported are covered.

    Returns:
        the names ("module.attribute") registered by this call (empty when all were registered before).
    """
    added = []
    with _lock:
        for known in known_functions(import_all):
            try:
                module = sys.modules.get(known.module) or importlib.import_module(known.module)
            except Exception as exc:  # an optional package that does not import here (e.g. FLA without triton)
                log.debug("qla_compile: skipping %s: %s", known.module, exc)
                continue
            original = getattr(module, known.attribute, None)
            for fn in _unwrap_chain(original):
                if id(fn) in _registered:
                    continue
                name = f"{known.module}.{known.attribute}"
                torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(known.substitute)
                _registered[id(fn)] = (fn, name)
                added.append(name)
    for name in added:
        log.info("qla_compile: dynamo substitution registered for %s", name)
    return added


def refresh() -> None:
    """Cheap per-call hook: register newly imported modules' functions when ``sys.modules`` has grown."""
    global _modules_seen
    if len(sys.modules) != _modules_seen:
        _modules_seen = len(sys.modules)
        register_substitutions()


def registered() -> list[str]:
    """Names of the functions substituted so far (one entry per registered object)."""
    return [name for _, name in _registered.values()]


def is_substituted(fn) -> bool:
    return id(fn) in _registered
