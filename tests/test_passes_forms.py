"""The FX pass on the collection of ``gdn_forms`` under ``torch.compile(backend=...)`` on CPU: every GDN form is
fused into one call of our op, every look-alike is left as it was (``pass_checks``); outputs and gradients match
eager, and the pass stays within its time budget."""
import pytest
import torch
import torch.nn.functional as F
from gdn_forms import FORMS, LOOK_ALIKES, chunk_solve_c64, gdn_read_before_update, recurrent_repeat_interleave, \
    retention_scalar_gate
from gdn_inputs import make_inputs, outputs_and_grads, rel_err
from pass_checks import NAMES, check_form_fused, check_look_alike_left_alone
from pass_checks import compiled as _compiled

from qla_compile.passes.fuse import PASS_BUDGET_SECONDS
from qla_compile.passes.prove import NotProven


@pytest.mark.parametrize("name", FORMS)
def test_form_is_fused_and_matches_eager(name):
    check_form_fused(name)


#: The chunked forms and their chunk sizes (from their names).
ONE_CHUNK = {name: int(name.rsplit("_c", 1)[1]) for name in FORMS if name.startswith("chunk_")}


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_chunked_form_is_fused_at_one_chunk(name):
    """A chunked form over exactly one chunk: its loop runs once, the state update after it is dead code, so the
    region has no state chain and its in-chunk gate sums (by ``cumsum`` or a triangular matmul) and their masked
    pairwise decay (by a select, an additive -inf mask, a clamp) are all there is to find."""
    check_form_fused(name, T=ONE_CHUNK[name])


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alike_is_left_alone(name):
    check_look_alike_left_alone(name)


@pytest.mark.parametrize("fn, fused", [(recurrent_repeat_interleave, True), (gdn_read_before_update, False)])
def test_pass_time_on_a_long_unrolled_recurrence(fn, fused):
    """A 128-token recurrence unrolls into a graph of some thousands of nodes; the pass proves (or, for the
    look-alike, rejects under every binding) its one region before its time budget runs out. (On a quiet two-core
    machine: 0.2 s and 0.7 s alone; inside the whole suite on the same machine the look-alike took 2.0-2.4 s, so a
    tighter wall-clock bound than the budget fails on load, not on the pass.)"""
    kw = make_inputs(B=1, T=128, H=2, HV=4 if fused else 2, K=16, V=16, l2norm=True, seed=9)
    *_, report = _compiled(fn, [kw[n] for n in NAMES], differentiable=False)
    assert report.nodes_before > 2000, report.summary()
    assert [r.status for r in report.regions] == ["replaced" if fused else "rejected"], report.summary()
    assert not any(NotProven.TIMEOUT in r.reason for r in report.regions), report.summary()
    assert report.pass_seconds < PASS_BUDGET_SECONDS, report.summary()


def test_two_layers_and_a_look_alike_in_one_graph():
    """A recurrence, a projection, a one-chunk WY form reading q and v as slices of one tensor, and a look-alike
    reading the second layer's output: the two GDN regions are fused, the look-alike left, and all agree with
    eager."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 16)

    def layers(q, k, v, g, beta, h0):
        x = proj(recurrent_repeat_interleave(q, k, v, g, beta))
        o, state = chunk_solve_c64(x[:, :, :2], k, x, g, beta, h0)
        return o + retention_scalar_gate(q, k, o[:, :, 2:], g[:, :, 2:], beta[:, :, 2:]).repeat(1, 1, 2, 1), state

    kw = make_inputs(B=2, T=24, H=2, HV=4, K=16, V=16, initial_state=True, seed=10)
    args = [kw[n] for n in NAMES] + [kw["initial_state"]]
    eager, eager_grads = outputs_and_grads(layers, args)
    outs, grads, report = _compiled(layers, args)
    assert [r.status for r in report.regions] == ["replaced", "replaced", "rejected"], report.summary()
    roles = dict(r.split("=") for r in report.regions[1].reason.split(";")[0].replace(",", "").split())
    assert roles["q"] != roles["v"], report.summary()  # q is the slice x[:, :, :2], v all of x
    assert all(rel_err(o, e) < 1e-4 for o, e in zip(outs, eager))
    assert all(rel_err(d, e) < 1e-3 for d, e in zip(grads, eager_grads))


def test_a_layer_slicing_q_k_v_from_one_projection():
    """q, k, v as slices of one projection (head splits after the slices) and the gates as ``-softplus(a)`` and
    ``sigmoid(b)``, into the recurrence: the region starts after the slices, head splits and the negation."""
    torch.manual_seed(0)
    B, T, H, K, D = 2, 12, 2, 16, 32
    qkv_proj, gate_proj = torch.nn.Linear(D, 3 * H * K), torch.nn.Linear(D, 2 * H)

    def layer(x):
        qkv = qkv_proj(x)
        q, k, v = (qkv[..., i * H * K:(i + 1) * H * K].reshape(B, T, H, K) for i in range(3))
        a, b = gate_proj(x).chunk(2, -1)
        return recurrent_repeat_interleave(q, k, v, -F.softplus(a), b.sigmoid())

    x = torch.randn(B, T, D)
    eager, eager_grads = outputs_and_grads(layer, [x])
    outs, grads, report = _compiled(layer, [x])
    assert [r.status for r in report.regions] == ["replaced"], report.summary()
    assert rel_err(outs[0], eager[0]) < 1e-4 and rel_err(grads[0], eager_grads[0]) < 1e-3
