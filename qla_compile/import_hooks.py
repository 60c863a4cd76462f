"""Run a function once a module is imported, without importing it: at once when it already is, else right after
its import, by a finder on ``sys.meta_path`` that wraps the module's own loader (and leaves once nothing is
pending). ``qla_compile`` uses it for FLA's backend registry and for dynamo's compile-start callbacks."""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)
_pending: dict[str, list] = {}


def when_imported(name: str, callback) -> None:
    """Call ``callback()`` once the module ``name`` has executed (now, if it has)."""
    if name in sys.modules:
        callback()
        return
    _pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a watched module through the other finders and gives its spec a loader that runs the callbacks."""

    def find_spec(self, fullname, path, target=None):
        callbacks = _pending.pop(fullname, None)
        if callbacks is None:
            return None
        if not _pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the real search (this finder holds nothing for it now)
        if spec is None or spec.loader is None:
            for callback in callbacks:
                when_imported(fullname, callback)
            return spec
        spec.loader = _CallbacksAfter(spec.loader, callbacks)
        return spec


class _CallbacksAfter(importlib.abc.Loader):
    """A module's own loader, then the callbacks (a failing one is logged; the import stands)."""

    def __init__(self, loader, callbacks):
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001  (the user's import must not fail on our account)
                log.warning("qla_compile: %s after importing %s failed: %s", callback.__qualname__,
                            module.__name__, exc)

    def __getattr__(self, name):  # get_source, get_filename, ... as the module's own loader answers them
        return getattr(self._loader, name)


_FINDER = _Finder()
