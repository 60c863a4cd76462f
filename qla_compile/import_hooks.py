"""Run a function once a module is imported, without importing it: at once when it already is, else right after
its import, by a finder on ``sys.meta_path`` that wraps the module's own loader. ``qla_compile`` uses it for
FLA's backend registry and to register its dynamo substitutions as FLA's and transformers' modules arrive."""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)
_pending: dict[str, list] = {}  # module name -> callbacks, each called once
_prefixes: list[tuple[str, object]] = []  # (prefix, callback(module)), for every module below the prefix
_searching: set[str] = set()  # names this finder is looking up through the others


def when_imported(name: str, callback) -> None:
    """Call ``callback()`` once the module ``name`` has executed (now, if it has)."""
    if name in sys.modules:
        callback()
        return
    _pending.setdefault(name, []).append(callback)
    _watch()


def when_imported_under(prefix: str, callback) -> None:
    """Call ``callback(module)`` for every module whose name starts with ``prefix``: those imported now, and each
    one imported later, right after it executes."""
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix) and module is not None:
            callback(module)
    _prefixes.append((prefix, callback))
    _watch()


def _watch():
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a watched module through the other finders and gives its spec a loader that runs the callbacks."""

    def find_spec(self, fullname, path, target=None):
        if fullname in _searching:
            return None
        once = _pending.pop(fullname, [])
        callbacks = [lambda module, c=c: c() for c in once]
        callbacks += [c for prefix, c in _prefixes if fullname.startswith(prefix)]
        if not callbacks:
            return None
        _searching.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # the real search (this finder steps aside for it)
        finally:
            _searching.discard(fullname)
        if spec is None or spec.loader is None:
            if once:
                _pending[fullname] = once  # not importable (yet): still watched
            return spec
        spec.loader = _CallbacksAfter(spec.loader, callbacks)
        return spec


class _CallbacksAfter(importlib.abc.Loader):
    """A module's own loader, then the callbacks with the module (a failing one is logged; the import stands)."""

    def __init__(self, loader, callbacks):
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            try:
                callback(module)
            except Exception as exc:  # noqa: BLE001  (the user's import must not fail on our account)
                log.warning("qla_compile: a hook after importing %s failed: %s", module.__name__, exc)

    def __getattr__(self, name):  # get_source, get_filename, ... as the module's own loader answers them
        return getattr(self._loader, name)


_FINDER = _Finder()
