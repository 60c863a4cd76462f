"""The FX pass on eager GDN written in ways no library writes it, and on look-alikes it must leave alone.

Each variant is checked against the float64 per-token oracle (``recurrent_gdr_reference``), so a variant
that is itself wrong would fail here rather than be "proven" against a wrong op.
"""
import pytest
import torch
import torch.nn.functional as F

import qla_compile as qb
from gdn_inputs import make_inputs, rel_err
from qla_compile import recurrent_gdr_reference

C = 16  # chunk size of the hand-written variants


def _chunks(x):  # [B, H, T, D] -> [B, H, N, C, D]
    return x.reshape(x.shape[0], x.shape[1], -1, C, x.shape[-1])


def _unit_lower_inverse_by_doubling(a):
    """(I - a)^-1 for strictly lower a, as the product (I + a)(I + a^2)(I + a^4)...: no solve, no row loop."""
    eye = torch.eye(C, dtype=a.dtype)
    inv, power = eye + a, a
    for _ in range(C.bit_length() - 1):
        power = power @ power
        inv = inv @ (eye + power)
    return inv


def _carry_chunks(q, k, u, w, attn, G):
    """The chunk-to-chunk state carry of the chunked head-major variants (``u``, ``w`` from the inverse,
    ``attn`` the decayed in-chunk scores): outputs ``[B, H, T, V]``."""
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], u.shape[-1])
    outs = []
    for n in range(q.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append((q[:, :, n] * G[:, :, n, :, None].exp()) @ S + attn[:, :, n] @ v_new)
        k_tail = k[:, :, n] * (G[:, :, n, -1:] - G[:, :, n]).exp()[..., None]
        S = S * G[:, :, n, -1, None, None].exp() + torch.einsum("bhck,bhcv->bhkv", k_tail, v_new)
    return torch.stack(outs, dim=2).flatten(2, 3)


def gdn_head_major_einsum(q, k, v, g, beta):
    """Inputs head-major [B, H, T, D] / [B, H, T]; einsum everywhere; inverse by repeated squaring."""
    q = q * q.shape[-1] ** -0.5
    q, k, v = _chunks(q), _chunks(k), _chunks(v)
    g, beta = g.reshape(*g.shape[:2], -1, C), beta.reshape(*beta.shape[:2], -1, C)
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    decay = torch.where(causal, (G[..., :, None] - G[..., None, :]).masked_fill(~causal, 0).exp(), 0.0)
    kk = torch.einsum("bhncd,bhnsd->bhncs", k * beta[..., None], k) * decay
    inv = _unit_lower_inverse_by_doubling(-kk.tril(-1))
    u = torch.einsum("bhncs,bhnsd->bhncd", inv, v * beta[..., None])
    w = torch.einsum("bhncs,bhnsd->bhncd", inv, k * (beta * G.exp())[..., None])
    return _carry_chunks(q, k, u, w, torch.einsum("bhncd,bhnsd->bhncs", q, k) * decay, G)


def gla_chunked(q, k, v, g, beta):
    """Gated linear attention: the same chunk-decay anchor, no delta rule (beta only scales v)."""
    q, k, v = _chunks(q * q.shape[-1] ** -0.5), _chunks(k), _chunks(v * beta[..., None])
    G = g.reshape(*g.shape[:2], -1, C).cumsum(-1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(), -1e9).exp()
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    outs = []
    for n in range(q.shape[2]):
        outs.append((q[:, :, n] * G[:, :, n, :, None].exp()) @ S + (q[:, :, n] @ k[:, :, n].transpose(-1, -2) * decay[:, :, n]) @ v[:, :, n])
        S = S * G[:, :, n, -1, None, None].exp() + (k[:, :, n] * (G[:, :, n, -1:] - G[:, :, n]).exp()[..., None]).transpose(-1, -2) @ v[:, :, n]
    return torch.stack(outs, dim=2).flatten(2, 3)


def linear_attention(q, k, v, g, beta):
    return torch.tril(q @ k.transpose(-1, -2)) @ v


def softmax_attention(q, k, v, g, beta):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) + torch.softmax(g.cumsum(-1), -1)[..., None]


def _head_major_inputs(seed):
    kw = make_inputs(B=2, T=48, H=2, HV=2, K=16, V=16, seed=seed)
    return tuple(kw[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "g", "beta")), kw


def _compile(fn, args):
    torch._dynamo.reset()
    backend = qb.make_backend(inductor=False)
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (report,) = backend.reports
    return out, report


def _assert_fused(fn, seed):
    """``fn`` (head-major) is GDN by the float64 oracle, and the pass replaces its one region with equal outputs."""
    args, kw = _head_major_inputs(seed=seed)
    oracle = recurrent_gdr_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])[0].transpose(1, 2)
    assert rel_err(fn(*args), oracle) < 1e-5  # the variant really is GDN
    out, report = _compile(fn, args)
    assert [r.status for r in report.regions] == ["replaced"], report.summary()
    assert rel_err(out, oracle) < 1e-5
    return report


def test_head_major_einsum_doubling_inverse_is_fused():
    report = _assert_fused(gdn_head_major_einsum, seed=3)
    assert "layouts HHHHH" in report.regions[0].reason


@pytest.mark.parametrize("fn", [gla_chunked, linear_attention, softmax_attention])
def test_look_alikes_are_left_alone(fn):
    args, _ = _head_major_inputs(seed=4)
    out, report = _compile(fn, args)
    assert report.nodes_after == report.nodes_before and report.fused_calls == 0, report.summary()
    assert all(r.status == "rejected" for r in report.regions)
    assert rel_err(out, fn(*args)) < 1e-6


def test_gla_is_a_candidate_rejected_by_the_proof():
    args, _ = _head_major_inputs(seed=5)
    _, report = _compile(gla_chunked, args)
    assert len(report.regions) == 1 and "differ" in report.regions[0].reason, report.summary()


def test_a_region_that_fails_to_run_prints_nothing(capfd, monkeypatch):
    """A binding under which the region's own code raises (here every binding: the extracted region is replaced by
    one that fails) costs a line in the report, no traceback on the console (as an FX GraphModule would print)."""
    from qla_compile.passes import prove

    def failing(gm, region):
        return lambda *args: torch.linalg.cholesky(-torch.eye(2))  # not positive-definite

    monkeypatch.setattr(prove, "extract", failing)
    args, _ = _head_major_inputs(seed=6)
    _, report = _compile(gdn_head_major_einsum, args)
    assert [r.status for r in report.regions] == ["rejected"], report.summary()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "FX-traced" not in err, err


def test_the_pass_stops_at_its_time_budget(monkeypatch):
    """Proofs stop once the pass has spent its budget; the region left is reported with that reason, unchanged."""
    from qla_compile.passes import fuse

    monkeypatch.setattr(fuse, "PASS_BUDGET_SECONDS", 0.0)
    args, kw = _head_major_inputs(seed=7)
    torch._dynamo.reset()
    backend = qb.make_backend(inductor=False)
    out = torch.compile(gdn_head_major_einsum, backend=backend, fullgraph=True)(*args)
    (report,) = backend.reports
    assert [r.status for r in report.regions] == ["rejected"], report.summary()
    assert report.regions[0].reason.startswith("the pass's time budget ran out"), report.summary()
    assert rel_err(out, gdn_head_major_einsum(*args)) < 1e-6


def gdn_where_full_like_solve(q, k, v, g, beta):
    """Head-major, a ``where(causal, diff, full_like(diff, -inf))`` decay mask and an explicit triangular solve:
    the mask's constant is built inside the region from one of its own tensors."""
    q = q * q.shape[-1] ** -0.5
    q, k, v = _chunks(q), _chunks(k), _chunks(v)
    g, beta = g.reshape(*g.shape[:2], -1, C), beta.reshape(*beta.shape[:2], -1, C)
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = G[..., :, None] - G[..., None, :]
    decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
    a = (torch.einsum("bhncd,bhnsd->bhncs", k * beta[..., None], k) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u = inv @ (v * beta[..., None])
    w = inv @ (k * (beta * G.exp())[..., None])
    return _carry_chunks(q, k, u, w, torch.einsum("bhncd,bhnsd->bhncs", q, k) * decay, G)


def test_constants_built_inside_the_region_stay_inside():
    """``full_like`` of a region tensor is part of the region, not one of its inputs: the form is fused."""
    _assert_fused(gdn_where_full_like_solve, seed=8)


def test_extracted_region_runs_as_the_graph_does():
    """``prove.extract`` runs a region's nodes without a GraphModule of their own: on a traced graph with a method
    call with keywords, a node as a keyword, nodes nested in a list and in slice bounds, an in-place write, a
    submodule and a parameter read (``get_attr``), the region of every node between the inputs and the output gives
    what the graph's own generated code gives."""
    from torch import fx

    from qla_compile.passes.prove import extract
    from qla_compile.passes.regions import Region

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.w = torch.nn.Parameter(torch.randn(4))

        def forward(self, x, y):
            n = x.size(1) // 2
            z = torch.cat([x[:, :n], y[:, n:]], dim=1).sum(dim=-1, keepdim=True)
            s = torch.add(self.proj(x).flip(dims=[0]), other=self.w)
            t = s.clone()
            t.mul_(z)
            return torch.stack((t, s), dim=0), z

    gm = fx.symbolic_trace(Net())
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    region = Region(nodes[0], list(gm.graph.output_node().args[0]), nodes, list(gm.graph.find_nodes(op="placeholder")))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert {n.op for n in nodes} == {"call_function", "call_method", "call_module", "get_attr"}
    for got, want in zip(extract(gm, region)(x, y), gm(x, y), strict=True):
        assert torch.equal(got, want)
