"""Prove a candidate region: run it and our op on the same random inputs, for each plausible binding.

A binding says which region input is q, k, v, g, beta (and optionally the initial state), in which layout
(token-major ``[B,T,H,D]`` or head-major ``[B,H,T,D]``), whether q/k are L2-normalised inside, the output
scale (fitted: o is linear in it) and the output layout.  GVA needs no option: the op's head mapping
(v-head h reads qk-head h // G) is checked like everything else.  A binding is accepted only if it matches
on two independent random draws; the region is then known to compute ``chunk_gated_delta_rule``.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..reference import GDROptions, chunk_gdr_fwd_reference
from .dataflow import is_tensor, value, written
from .regions import Region

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
_HALF_TOLERANCE = 2e-2
_MAX_HYPOTHESES = 256


@dataclass(frozen=True)
class Binding:
    """How a proven region maps onto ``qla::chunk_gdr_fwd``; indices refer to ``Region.inputs``."""

    q: int
    k: int
    v: int
    g: int
    beta: int
    initial_state: int | None
    head_major: tuple[bool, bool, bool, bool, bool]   # q, k, v, g, beta
    state_v_first: bool
    l2norm: bool
    scale: float
    output_head_major: bool
    output_dtype: torch.dtype


class NotProven(Exception):
    """The region is not a gated delta rule under any binding (the message says why)."""

    DIFFER = "outputs differ from the delta rule"
    TIMEOUT = "the pass's time budget ran out"


def extract(gm: fx.GraphModule, region: Region):
    """The region as a function: inputs -> outputs, its nodes called in order, each with its arguments picked from one
    list of values by ``operator.itemgetter`` (the inputs, the nodes' results, then the constants from the end).
    A region of an unrolled recurrence has thousands of nodes, and a look-alike's bindings run it some dozens of
    times: copying the nodes into a GraphModule of their own and compiling its Python took longer than all those
    runs, and ``fx.Interpreter``'s per-node bookkeeping three times as long as the runs."""
    n_in = len(region.inputs)
    slot = {node: i for i, node in enumerate(region.inputs)}
    consts, steps = [], []

    def position(arg):
        """Where ``arg`` is in the list: its node's result, a step's that builds it from nodes, or a constant."""
        if isinstance(arg, fx.Node):
            return slot[arg]
        if isinstance(arg, (tuple, list, dict, slice)) and _has_nodes(arg):
            if isinstance(arg, dict):
                return step(lambda *xs, keys=tuple(arg): dict(zip(keys, xs)), arg.values())
            if isinstance(arg, slice):
                return step(slice, (arg.start, arg.stop, arg.step))
            return step(lambda *xs, kind=tuple if isinstance(arg, tuple) else list: kind(xs), arg)
        consts.append(arg)
        return -len(consts)

    def step(fn, args):
        picks = [position(a) for a in args]
        steps.append((n_in + len(steps), fn, _picker(picks)))
        return steps[-1][0]

    for node in region.nodes:
        fn = _callee(gm, node)
        if node.kwargs:
            fn = _with_keys(fn, tuple(node.kwargs), len(node.args))
        slot[node] = step(fn, (*node.args, *node.kwargs.values()))
    outputs = _picker([slot[written(o)] for o in region.outputs])
    tail = [None] * len(steps) + consts[::-1]

    def run(*args):
        env = [*args, *tail]
        for k, fn, pick in steps:
            env[k] = fn(*pick(env))
        return outputs(env)

    return run


def _has_nodes(arg) -> bool:
    """Whether a node is somewhere in ``arg``."""
    found = []
    fx.node.map_arg(arg, found.append)
    return bool(found)


def _picker(positions):
    """``env -> tuple(env[p] for p in positions)``."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        p = positions[0]
        return lambda env: (env[p],)
    return lambda env: ()


def _with_keys(fn, keys, n_positional):
    """``fn`` called with its last ``len(keys)`` arguments as those keywords."""
    return lambda *xs: fn(*xs[:n_positional], **dict(zip(keys, xs[n_positional:])))


def _callee(gm: fx.GraphModule, node: fx.Node):
    """What running ``node`` calls with its arguments."""
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return lambda obj, *args, **kwargs: getattr(obj, node.target)(*args, **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    if node.op == "get_attr":
        attr = operator.attrgetter(node.target)(gm)
        return lambda: attr
    raise NotProven(f"region node {node.name} is a {node.op}")


def hint_int(x) -> int:
    """The concrete value dynamo traced a size with. torch's helper is imported on first use: its module
    pulls in sympy, which an eager ``import qla_compile`` should not pay for."""
    import torch.fx.experimental.symbolic_shapes as shapes

    # torch 2.13's name, then 2.11's (which warns on the older hint_int), then hint_int
    hint = getattr(shapes, "optimization_hint", None) or getattr(shapes, "size_hint", None) or shapes.hint_int
    return hint(x)


def _shape(node) -> list[int]:
    return [hint_int(s) for s in value(node).shape]


def _concrete(x):
    """A SymInt/SymFloat/size as the plain number dynamo traced it with."""
    if isinstance(x, torch.SymInt):
        return hint_int(x)
    if isinstance(x, torch.SymBool):
        return bool(x.node.hint)
    if isinstance(x, torch.SymFloat):
        return x.node.hint
    if isinstance(x, (tuple, list, torch.Size)):
        return type(x)(_concrete(y) for y in x) if not isinstance(x, torch.Size) else torch.Size(map(_concrete, x))
    return x


def _dims(shape, head_major):
    """(B, T, H, D...) of a token-major or head-major shape."""
    if head_major:
        return (shape[0], shape[2], shape[1], *shape[3:])
    return tuple(shape)


def _hypotheses(region: Region):
    """Structural bindings consistent with the input shapes (roles and layouts), without options."""
    tensors = [i for i, n in enumerate(region.inputs) if is_tensor(n)]
    four = [i for i in tensors if value(region.inputs[i]).dim() == 4]
    three = [i for i in tensors if value(region.inputs[i]).dim() == 3]
    if len(four) + len(three) != len(tensors):
        odd = [region.inputs[i].name for i in tensors if i not in four and i not in three]
        raise NotProven(f"inputs other than 3-D/4-D tensors: {odd}")
    if len(three) != 2 or len(four) not in (3, 4):
        raise NotProven(f"needs 3 or 4 four-dim inputs (q, k, v, initial state) and 2 three-dim inputs "
                        f"(g, beta); found {len(four)} and {len(three)}")
    shape = {i: _shape(region.inputs[i]) for i in tensors}
    out_shapes = [_shape(written(o)) for o in region.outputs]
    for q, k, v, *h0 in itertools.permutations(four):
        for g, beta in itertools.permutations(three):
            for hm in itertools.product((False, True), repeat=5):
                dq, dk, dv = (_dims(shape[x], m) for x, m in zip((q, k, v), hm))
                dg, db = (_dims(shape[x], m) for x, m in zip((g, beta), hm[3:]))
                B, T, H, K = dq
                HV, V = dv[2], dv[3]
                if dk != dq or dv[:2] != (B, T) or HV % H or dg != (B, T, HV) or db != dg:
                    continue
                if not _outputs_fit(out_shapes, B, T, HV, K, V):
                    continue
                if not h0:
                    yield (q, k, v, g, beta, None, hm, False)
                    continue
                for v_first in (False, True):
                    if tuple(shape[h0[0]]) == ((B, HV, V, K) if v_first else (B, HV, K, V)):
                        yield (q, k, v, g, beta, h0[0], hm, v_first)


def _outputs_fit(shapes, B, T, HV, K, V) -> bool:
    """The region's outputs are shaped like o (token- or head-major) and, if there, a final state."""
    o_fits = shapes[0] in ([B, T, HV, V], [B, HV, T, V])
    return o_fits and (len(shapes) == 1 or shapes[1] in ([B, HV, K, V], [B, HV, V, K]))


def _device(region: Region) -> torch.device:
    """Where the region computes: its tensor inputs' device (its constants are made there too)."""
    return next(value(n).device for n in region.inputs if is_tensor(n))


def _draw(region: Region, hyp, seed: int) -> tuple[list, dict]:
    """Random region inputs for a hypothesis, on the region's device, and the same values in the op's canonical
    layout (drawn on the CPU, so that a draw is the same everywhere)."""
    q, k, v, g, beta, h0, hm, v_first = hyp
    device = _device(region)
    gen = torch.Generator().manual_seed(seed)
    shapes = {i: _dims(_shape(region.inputs[i]), m) for i, m in zip((q, k, v, g, beta), hm)}
    B, T, H, K = shapes[q]
    HV, V = shapes[v][2], shapes[v][3]
    strength = torch.linspace(0.0, 4.0, HV)
    canon = {
        "q": torch.randn(B, T, H, K, generator=gen),
        # keys of norm 0.5..1: stable without a norm, and changed by one (so L2 on/off is told apart)
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
        * (0.5 + 0.5 * torch.rand(B, T, H, 1, generator=gen)),
        "v": torch.randn(B, T, HV, V, generator=gen),
        "g": -strength * F.softplus(torch.randn(B, T, HV, generator=gen)) - 0.01,
        "beta": torch.rand(B, T, HV, generator=gen),
    }
    if h0 is not None:
        canon["initial_state"] = 0.3 * torch.randn(B, HV, V, K, generator=gen) if v_first else \
            0.3 * torch.randn(B, HV, K, V, generator=gen)
    canon = {name: x.to(device) for name, x in canon.items()}
    args = []
    roles = dict(zip((q, k, v, g, beta), ("q", "k", "v", "g", "beta")))
    layouts = dict(zip((q, k, v, g, beta), hm))
    if h0 is not None:
        roles[h0], layouts[h0] = "initial_state", False
    for i, role in roles.items():  # the op sees the values the region does: rounded to the input's dtype
        canon[role] = canon[role].to(value(region.inputs[i]).dtype).float()
    for i, node in enumerate(region.inputs):
        if i in roles:
            x = canon[roles[i]]
            x = x.transpose(1, 2) if layouts[i] else x
            args.append(x.to(value(node).dtype).contiguous())
        elif isinstance(value(node), torch.Tensor):
            raise NotProven(f"input {node.name} has no role")
        else:
            args.append(_concrete(value(node)))
    return args, canon


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class _OpRuns:
    """Our op's function on canonical fp32 inputs, by its reference implementation (on a GPU the op would pick
    other kernels for fp32, less exact than a proof needs).  Runs are remembered by their inputs' values: every
    binding of one region draws the same canonical values (only which region input gets which differs), so a
    region with many bindings runs the op once per option set, not once per binding."""

    def __init__(self):
        self._runs: list[tuple[dict, bool, bool, tuple]] = []

    def __call__(self, canon: dict, l2norm: bool, v_first: bool):
        for seen, seen_l2norm, seen_v_first, result in self._runs:
            if (seen_l2norm, seen_v_first) == (l2norm, v_first) and seen.keys() == canon.keys() and all(
                    torch.equal(seen[n], x) for n, x in canon.items()):
                return result
        opts = GDROptions(1.0, l2norm, False, False, False, v_first)
        result = chunk_gdr_fwd_reference(canon["q"], canon["k"], canon["v"], canon["g"], canon["beta"], None, None,
                                         canon.get("initial_state"), None, opts)
        self._runs.append((canon, l2norm, v_first, result))
        return result


def _tolerance(region: Region) -> float:
    """Relative error allowed, by the lowest floating precision any tensor of the region has."""
    floats = {value(n).dtype for n in (*region.inputs, *region.nodes) if is_tensor(n) and value(n).is_floating_point()}
    if floats & {torch.float16, torch.bfloat16}:
        return _HALF_TOLERANCE
    return _TOLERANCE[torch.float64 if floats == {torch.float64} else torch.float32]


def _match(region: Region, sub: Callable, run_op: _OpRuns, hyp, seed: int, tol: float,
           fixed: dict | None = None):
    """(error, options) of the best option set for one hypothesis on one random draw."""
    args, canon = _draw(region, hyp, seed)
    outs = sub(*args)
    o_ref = outs[0]
    st_ref = outs[1] if len(outs) > 1 else None
    if not isinstance(o_ref, torch.Tensor) or o_ref.dim() != 4:
        raise NotProven("the region's output is not a 4-D tensor")
    h0_v_first = hyp[7]
    # a final state without an initial one may be laid out either way
    v_firsts = (h0_v_first,) if hyp[5] is not None or st_ref is None else (False, True)
    best = (math.inf, None)
    for l2norm in ((fixed["l2norm"],) if fixed else (False, True)):
        o1, st1 = run_op(canon, l2norm, h0_v_first)
        for v_first in ((fixed["state_v_first"],) if fixed else v_firsts):
            st = st1 if v_first == h0_v_first else st1.mT
            if st_ref is not None and tuple(st_ref.shape) != tuple(st.shape):
                continue
            st_err = 0.0 if st_ref is None else _rel_err(st_ref, st)
            for head_major in ((fixed["output_head_major"],) if fixed else (False, True)):
                o_can = o_ref.transpose(1, 2) if head_major else o_ref
                if tuple(o_can.shape) != tuple(o1.shape):
                    continue
                o1d, od = o1.double(), o_can.double()
                scale = fixed["scale"] if fixed else (od * o1d).sum().item() / max((o1d * o1d).sum().item(), 1e-30)
                err = max(_rel_err(o_can, scale * o1d), st_err)
                if err < best[0]:
                    best = (err, dict(l2norm=l2norm, state_v_first=v_first, output_head_major=head_major,
                                      scale=_snap(scale, canon["q"], tol), output_dtype=o_ref.dtype))
    return best


def _snap(scale: float, q: torch.Tensor, tol: float) -> float:
    """K^-0.5 or 1 where the fitted scale is that within the tolerance (the second draw checks it)."""
    for nice in (q.shape[-1] ** -0.5, 1.0):
        if abs(scale - nice) <= tol * nice:
            return nice
    return scale


@contextlib.contextmanager
def _one_cpu_thread():
    """Within: torch's CPU ops on one thread.  A proof runs many small ops, which OpenMP's threads only slow down,
    and by far where the cores are busy (a 64x64 triangular solve: 30 ms on two threads of a loaded two-core
    machine, 0.1 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prove(gm: fx.GraphModule, region: Region, deadline: float = math.inf) -> Binding:
    """The binding under which the region equals our op on two random draws; raises ``NotProven``, also once
    ``time.perf_counter()`` passes ``deadline``."""
    if time.perf_counter() > deadline:
        raise NotProven(f"{NotProven.TIMEOUT} before its first binding")
    sub = extract(gm, region)
    tol = _tolerance(region)
    best_err = math.inf
    run_op = _OpRuns()
    with unset_fake_temporarily(), torch.no_grad(), _one_cpu_thread():
        for n, hyp in enumerate(_hypotheses(region)):
            if n == _MAX_HYPOTHESES:
                break
            if time.perf_counter() > deadline:
                raise NotProven(f"{NotProven.TIMEOUT} after {n} binding(s)")
            try:
                err, opts = _match(region, sub, run_op, hyp, 1234, tol)
            except NotProven:
                raise
            except Exception:  # noqa: BLE001  (a wrong binding may make the region itself fail)
                continue
            best_err = min(best_err, err)
            if opts is None or err > tol:
                continue
            err2, opts2 = _match(region, sub, run_op, hyp, 4321, tol, fixed=opts)
            if opts2 is None or err2 > tol:
                continue
            q, k, v, g, beta, h0, hm, _ = hyp
            return Binding(q, k, v, g, beta, h0, hm, opts["state_v_first"], opts["l2norm"], opts["scale"],
                           opts["output_head_major"], opts["output_dtype"])
    if best_err == math.inf:
        raise NotProven("no binding of the inputs fits q, k, v, g, beta shapes, or the region failed to run")
    raise NotProven(f"{NotProven.DIFFER} under every binding (best relative error {best_err:.2e})")
