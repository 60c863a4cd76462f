"""Our op for transformers' eager GDN models, without FLA and without compiling (in the style of Liger Kernel's
``apply_liger_kernel_to_*``).

:func:`apply_to_transformers` rebinds ``torch_chunk_gated_delta_rule`` in every transformers modeling module
that defines it (the model families found at run time, as the front door finds them) to a function with its
signature that calls ``qla_compile.chunk_gated_delta_rule``; layers look that name up at each call, so models
built before the call are covered too. Given a model, it also rebinds any GDN function its layers hold as an
attribute. :func:`revert_transformers` puts everything back. With FLA installed, transformers already sends
these calls to FLA's op, which our FLA backend serves; this is for the rest.
"""
from __future__ import annotations

import importlib
import threading

from ..patterns.known_functions import TRANSFORMERS_FN, transformers_chunk, transformers_gdn_modules

_LAYER_ATTRIBUTE = "chunk_gated_delta_rule"  # where layers of transformers <= 5.15 keep the function they call
_lock = threading.Lock()
_saved: list[tuple[object, str, object]] = []  # (owner, attribute, original), in the order they were rebound


def apply_to_transformers(model=None) -> list[str]:
    """Rebind transformers' eager GDN functions to our op; returns what was rebound ("module.attribute", and
    "ClassName.chunk_gated_delta_rule" for a model's layers). Idempotent; undone by :func:`revert_transformers`."""
    done = []
    with _lock:
        owners = [importlib.import_module(name) for name in transformers_gdn_modules(import_all=True)]
        owners += [] if model is None else [m for m in model.modules()
                                             if callable(getattr(m, _LAYER_ATTRIBUTE, None))]
        for owner in owners:
            attribute = TRANSFORMERS_FN if hasattr(owner, TRANSFORMERS_FN) else _LAYER_ATTRIBUTE
            original = getattr(owner, attribute)
            if original is transformers_chunk:
                continue
            _saved.append((owner, attribute, original))
            setattr(owner, attribute, transformers_chunk)
            done.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}")
    return done


def revert_transformers() -> int:
    """Undo every :func:`apply_to_transformers`; returns how many bindings were restored."""
    with _lock:
        for owner, attribute, original in reversed(_saved):
            setattr(owner, attribute, original)
        count = len(_saved)
        _saved.clear()
    return count
