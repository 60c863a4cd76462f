"""Front door: dynamo substitutions (``torch.compiler.substitute_in_graph``) for the known eager GDN functions.

With a substitution registered, dynamo traces one ``qla::chunk_gdr_fwd`` call where it would have unrolled
the chunk loop (a recompile per number of chunks) or broken the graph (FLA's ``torch.compiler.disable``).
Eager calls are unaffected: a substitution only applies while dynamo traces.

Registration is **global to the process** and idempotent.  It is keyed by object identity, so it must see
the objects the layers really call: a transformers layer looks its module-level function up at call time,
and that name is bound to the ``use_kernel_func_from_hub_with_fallback`` wrapper, so we register the wrapper
and every function below it along ``__wrapped__``.  :func:`install` registers each function as its module is
imported (FLA's, transformers' modeling modules), so the first trace of a model already goes through the front
door, whatever the backend and however often ``torch._dynamo.reset()`` runs; ``register_substitutions()`` does
it on demand.

**Never the unrolled loop.**  Should dynamo fail to trace a substitute (a graph break inside it), it calls
the original eagerly at the break and then traces the original's own frame: the chunk loop, unrolled, one
recompile per length.  So each plain function we register (no closure) also gets its code swapped for a
trampoline with the same signature that calls :func:`route`: while dynamo traces, or when the call runs
eagerly inside compiled code, that is the substitute (our op, in a graph or eagerly after a logged graph
break); otherwise the function's own body, unchanged (:func:`eager_body`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import threading
import types

import torch

from ..import_hooks import when_imported, when_imported_under
from ..patterns.known_functions import FLA_FUNCTIONS, TRANSFORMERS_MODELS, defines_transformers_gdn, known_functions

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registering = threading.local()  # .active: this thread is inside register_substitutions
_registered: dict[int, tuple[object, str]] = {}  # id(original) -> (original kept alive, "module.attribute")
_routes: dict[str, tuple[types.FunctionType, object]] = {}  # route key -> (the original's own body, substitute)
_unknown_modules: set[type] = set()  # module classes found where a GDN function was expected (logged once)


def unwrap_chain(fn):
    """``fn`` and each function reachable from it through ``__wrapped__``. A module that Hugging Face's ``kernels``
    package made of a function (transformers' hub decorators do, when ``kernels`` is installed) stands for the
    function its ``forward`` calls (:func:`_hub_function`)."""
    while fn is not None:
        if isinstance(fn, torch.nn.Module):
            fn = _hub_function(fn)
            continue
        yield fn
        fn = getattr(fn, "__wrapped__", None)


def _hub_function(module):
    """The function that a ``kernels`` function module (``use_kernel_forward_from_hub`` applied to a function: an
    ``nn.Module`` whose ``forward`` calls it, captured in its closure) calls, or None for any other module."""
    cells = getattr(type(module).forward, "__closure__", None) or ()
    functions = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
    if type(module).__qualname__.endswith("<locals>.Func") and len(functions) == 1:
        return functions[0]
    if type(module) not in _unknown_modules:  # said once per module class, however often registration runs
        _unknown_modules.add(type(module))
        log.warning("qla_compile: %s.%s is a module, not a function; its eager GDN is not replaced",
                    type(module).__module__, type(module).__qualname__)
    return None


def register_substitutions(import_all: bool = False) -> list[str]:
    """Register dynamo substitutions for every known eager GDN implementation importable now (and for FLA's
    layer leaves: :func:`_fla_leaves`).

    Args:
        import_all: also import every installed transformers modeling module that defines
            ``torch_chunk_gated_delta_rule``, and FLA's modules (a second or so); by default only modules
            already imported are covered.

    Returns:
        the names ("module.attribute") registered by this call (empty when all were registered before).
    """
    added = []
    with _lock:
        _registering.active = True  # modules this imports are registered here, not by their import hooks
        try:
            added = _register_known(import_all)
        finally:
            _registering.active = False
    for name in added:
        log.info("qla_compile: dynamo substitution registered for %s", name)
    return added


def _register_known(import_all: bool) -> list[str]:
    """The body of :func:`register_substitutions` (under its lock)."""
    added = []
    for known in known_functions(import_all):
        try:
            module = sys.modules.get(known.module) or importlib.import_module(known.module)
        except Exception as exc:  # an optional package that does not import here (e.g. FLA without triton)
            log.debug("qla_compile: skipping %s: %s", known.module, exc)
            continue
        original = getattr(module, known.attribute, None)
        for fn in unwrap_chain(original):
            if id(fn) in _registered:
                continue
            name = f"{known.module}.{known.attribute}"
            torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(known.substitute)
            _take_code(fn, known.substitute)
            _registered[id(fn)] = (fn, name)
            added.append(name)
    added += _fla_leaves(import_all)
    return added


def _fla_leaves(import_all: bool) -> list[str]:
    """FLA's layer leaves (short convolution, gated norm) as ``qla::`` ops while dynamo traces
    (``integrations.fla_leaves``): not GDN, but a graph break at each FLA GDN layer's convolution and norm
    otherwise."""
    from ..integrations import fla_leaves

    for name in fla_leaves.MODULES if import_all and importlib.util.find_spec("fla") is not None else ():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (an FLA that does not import here is no FLA)
            log.debug("qla_compile: skipping %s: %s", name, exc)
    return fla_leaves.register()


def route(key: str, *args, **kwargs):
    """The trampoline's target (see the module docstring): the substitute while dynamo traces or compiled code
    runs, else the original's own body."""
    body, substitute = _routes[key]
    if torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
        return substitute(*args, **kwargs)
    return body(*args, **kwargs)


def _route_key(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}#{id(fn)}"


def _take_code(fn, substitute) -> None:
    """Swap ``fn``'s code for a trampoline to :func:`route` (same parameters; defaults stay on ``fn``), for plain
    Python functions; closures and C functions keep their code."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ or fn.__code__.co_flags & (
            inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        return
    key = _route_key(fn)
    signature = inspect.signature(fn, follow_wrapped=False)
    bare = signature.replace(parameters=[p.replace(default=p.empty, annotation=p.empty)
                                         for p in signature.parameters.values()], return_annotation=signature.empty)
    forward = {inspect.Parameter.VAR_POSITIONAL: "*{}", inspect.Parameter.KEYWORD_ONLY: "{0}={0}",
               inspect.Parameter.VAR_KEYWORD: "**{}"}
    call = ", ".join(forward.get(p.kind, "{}").format(p.name) for p in signature.parameters.values())
    source = (f"def {fn.__name__}{bare}:\n"
              f"    from qla_compile.passes.frontdoor import route as _qla_route\n"
              f"    return _qla_route({key!r}, {call})\n")
    namespace: dict = {}
    exec(compile(source, f"<qla_compile front door: {fn.__module__}.{fn.__qualname__}>", "exec"), namespace)
    body = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, None)
    body.__kwdefaults__ = fn.__kwdefaults__
    _routes[key] = (body, substitute)
    fn.__code__ = namespace[fn.__name__].__code__


def eager_body(fn):
    """``fn`` as it was before the front door took its code (``fn`` itself where it did not)."""
    entry = _routes.get(_route_key(fn))
    return fn if entry is None else entry[0]


def install() -> None:
    """Register the substitutions before dynamo first traces what they cover, whatever the backend: now for the
    modules already imported, else right after each is imported (FLA's modules with a function they cover, every
    transformers modeling module that defines ``torch_chunk_gated_delta_rule``). Imports nothing itself."""
    from ..integrations import fla_leaves

    for module in sorted({known.module for known in FLA_FUNCTIONS} | set(fla_leaves.MODULES)):
        when_imported(module, _register_on_import)
    when_imported_under(TRANSFORMERS_MODELS, _register_if_gdn)


def _register_if_gdn(module) -> None:
    if defines_transformers_gdn(module):
        _register_on_import()


def _register_on_import() -> None:
    """:func:`register_substitutions` for a module just imported, unless a registration imported it (that one
    registers it, and names it in what it returns)."""
    if not getattr(_registering, "active", False):
        register_substitutions()


def registered() -> list[str]:
    """Names of the functions substituted so far (one entry per registered object), FLA's layer leaves
    (``integrations.fla_leaves``) among them."""
    from ..integrations import fla_leaves

    return [name for _, name in _registered.values()] + fla_leaves.registered()


def is_substituted(fn) -> bool:
    """Whether ``fn`` and every function below it (:func:`unwrap_chain`) trace as our op."""
    chain = list(unwrap_chain(fn))
    return bool(chain) and all(id(f) in _registered for f in chain)
