"""The SM90 forward kernels against the float64 per-token oracle (H200)."""
import math

import pytest
import torch

from gdn_inputs import make_inputs, rel_err, replayed
from qla_compile.reference import recurrent_gdr_reference

pytestmark = pytest.mark.gpu

TOL = 5e-3


def _kernels():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from qla_compile.kernels import forward as kernels

    return kernels


# the state kernels' DV tile, forced through the rule's threshold: all of V per CTA (what many heads or sequences
# get; an unsplit call then runs split_state_recurrence) or half of it (what few get: chunk_recurrence)
BLOCK_DV = ["full", "half"]
# the paths of an unsplit forward alone: all of V with the inverse on chip (chunk_fwd_split(inverse=True), what
# many heads or sequences get), all of V after kkt_inverse (what a forward a backward follows gets), half of V
PATHS = ["onchip"] + BLOCK_DV


def _force(monkeypatch, kernels, path):
    monkeypatch.setattr(kernels, "_FULL_DV_MIN_CTAS", 1 << 30 if path == "half" else 1)
    monkeypatch.setattr(kernels, "_onchip_inverse", lambda *_: path == "onchip")


def _case(B, T, H, HV, dtype, cu_seqlens=None, h0=True, l2norm=False, seed=0):
    kw = make_inputs(B, T, H, HV, 128, 128, cu_seqlens=cu_seqlens, initial_state=h0, l2norm=l2norm,
                     dtype=dtype, device="cuda", seed=seed)
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 128**-0.5, kw.get("initial_state"),
            kw.get("cu_seqlens"), l2norm)
    return kw, args


# 48 sequences of 0 to 210 tokens (empty ones, single tokens, partial and whole chunks)
_WALK_CU = [0]
for _i in range(48):
    _WALK_CU.append(_WALK_CU[-1] + (37 * _i) % 211)

CASES = {
    # name: (B, T, H, HV, dtype, cu_seqlens, h0, l2norm)
    "dense-gva4-T300-h0": (2, 300, 2, 8, torch.bfloat16, None, True, False),
    "dense-T1000-fp16": (1, 1000, 4, 4, torch.float16, None, False, False),
    "varlen-1tok-empty-h0": (1, 452, 2, 4, torch.bfloat16, [0, 1, 2, 130, 130, 194, 451, 452], True, False),
    "varlen-gva2-fp16-h0": (1, 777, 2, 4, torch.float16, [0, 63, 64, 65, 777], True, False),
    "l2norm-in-kernel": (1, 200, 2, 2, torch.bfloat16, None, True, True),
    "many-heads-varlen-h0": (1, 900, 4, 32, torch.bfloat16, [0, 64, 300, 301, 900], True, False),
    # 384 (sequence, v-head) pairs of uneven lengths, more than an H100/H200 has SMs
    "many-pairs-varlen-h0": (1, _WALK_CU[-1], 4, 8, torch.bfloat16, _WALK_CU, True, False),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_oracle(name, path, monkeypatch):
    kernels = _kernels()
    _force(monkeypatch, kernels, path)
    B, T, H, HV, dtype, cu, h0, l2 = CASES[name]
    kw, args = _case(B, T, H, HV, dtype, cu, h0, l2, seed=len(name))
    ran = []
    inverse = kernels._gate_inverse
    monkeypatch.setattr(kernels, "_gate_inverse", lambda *a, **k: ran.append("kkt_inverse") or inverse(*a, **k))
    o, ht = kernels.chunk_gdr_fwd_hopper(*args)
    assert ran == ([] if path == "onchip" else ["kkt_inverse"])
    ref_o, ref_ht = recurrent_gdr_reference(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw.get("initial_state"),
        output_final_state=True, cu_seqlens=kw.get("cu_seqlens"), use_qk_l2norm_in_kernel=l2,
    )
    assert o.dtype == dtype and o.shape == kw["v"].shape
    assert ht.dtype == torch.float32 and ht.shape == ref_ht.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, ref_o) <= TOL, rel_err(o, ref_o)
    assert rel_err(ht, ref_ht) <= TOL, rel_err(ht, ref_ht)


def test_few_ctas_walk_many_pairs(monkeypatch):
    """With the inverse on chip five split-state CTAs walk 384 (sequence, v-head) pairs as their queues deal them
    (a dense batch, and a varlen one of 0 to 210 tokens a sequence, walked here though ``_walks`` would give its
    pairs a CTA each), the input ring running on from one pair into the next and each next pair's h0 prefetched: the
    outputs and final states meet the oracle, and a second call (its ticket counter zeroed again) gives the same
    bits, as do two replays of a CUDA graph of the call (the counter zeroed in the graph on every replay)."""
    kernels = _kernels()
    _force(monkeypatch, kernels, "onchip")
    monkeypatch.setattr(kernels, "_sm_count", lambda *_: 5)
    split = kernels._split_state
    chosen = []

    def spy(n_pairs, device, walk=False, **params):
        chosen.append((n_pairs, walk))
        return split(n_pairs, device, True, **params)

    monkeypatch.setattr(kernels, "_split_state", spy)
    monkeypatch.setattr(kernels, "_WALK_MIN_TOKENS", 150)  # the dense batch's sequences are 150 tokens long
    for cu in (None, _WALK_CU):
        B, T = (48, 150) if cu is None else (1, _WALK_CU[-1])
        kw, args = _case(B, T, 4, 8, torch.bfloat16, cu, True, False, seed=5)
        o, ht = kernels.chunk_gdr_fwd_hopper(*args)
        ref_o, ref_ht = recurrent_gdr_reference(
            kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw["initial_state"],
            output_final_state=True, cu_seqlens=kw.get("cu_seqlens"),
        )
        assert rel_err(o, ref_o) <= TOL and rel_err(ht, ref_ht) <= TOL, (cu, rel_err(o, ref_o), rel_err(ht, ref_ht))
        o2, ht2 = kernels.chunk_gdr_fwd_hopper(*args)
        assert torch.equal(o, o2) and torch.equal(ht, ht2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o3, ht3 = kernels.chunk_gdr_fwd_hopper(*args)
        for _ in range(2):
            o3.zero_()
            ht3.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(o, o3) and torch.equal(ht, ht3), cu
    # by the rule: the dense batch walks, the varlen one (sequences shorter than the minimum) does not
    assert chosen == [(384, True)] * 3 + [(384, False)] * 3, chosen


def _builds(monkeypatch, kernels_of, name, record=lambda params: params):
    """The list that every build of the kernel ``name`` of ``kernels_of`` (a ``Kernels`` of the forward) appends
    ``record(its params)`` to from now on."""
    builds, real = [], getattr(kernels_of, name)

    def spied(**params):
        builds.append(record(params))
        return real(**params)

    monkeypatch.setattr(kernels_of, name, spied)
    return builds


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_onchip_reads_cu_seqlens_itself(cu_dtype, monkeypatch):
    """Where the host knows the sequence lengths, the on-chip forward builds no tables: the kernel reads the caller's
    int32 or int64 cu_seqlens and takes its order from the host, so no ``seq_tables`` launch, eager or captured. A
    graph replayed after other lengths are written into the same cu_seqlens (its order then stale, its pairs
    walked by five CTAs) meets the oracle of those lengths."""
    kernels = _kernels()
    _force(monkeypatch, kernels, "onchip")
    monkeypatch.setattr(kernels, "_sm_count", lambda *_: 5)
    monkeypatch.setattr(kernels, "_WALK_MIN_TOKENS", 0)
    launched = _builds(monkeypatch, kernels.seq_tables, "seq_tables")
    kw, args = _case(1, _WALK_CU[-1], 4, 8, torch.bfloat16, _WALK_CU, True, seed=3)
    cu = kw["cu_seqlens"].to(cu_dtype)
    args = (*args[:7], cu, *args[8:])

    def oracle(cu):
        return recurrent_gdr_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5,
                                       initial_state=kw["initial_state"], output_final_state=True, cu_seqlens=cu)

    kernels._host_lengths(cu, 1, _WALK_CU[-1])  # as a split rule that reads them does
    o, ht = kernels.chunk_gdr_fwd_hopper(*args)
    ref_o, ref_ht = oracle(cu)
    assert rel_err(o, ref_o) <= TOL and rel_err(ht, ref_ht) <= TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = kernels.chunk_gdr_fwd_hopper(*args)
    lens = torch.diff(torch.tensor(_WALK_CU)).flip(0)  # the longest sequences now elsewhere in the order
    cu.copy_(torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(cu))
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_ht = oracle(cu)
    assert rel_err(o_g, ref_o) <= TOL and rel_err(ht_g, ref_ht) <= TOL
    assert launched == []


def test_lengths_copied_without_waiting(monkeypatch):
    """A cu_seqlens whose lengths no split rule reads (64 v-heads: no plan of a forward alone splits them) is copied
    to the host without a synchronisation by the first on-chip forward, which builds its tables on the device; once
    that copy has landed the next call takes the lengths from it: no ``seq_tables`` launch, its pairs walked. Both
    meet the oracle and agree bit for bit."""
    kernels = _kernels()
    monkeypatch.setattr(kernels, "_WALK_MIN_TOKENS", 0)
    walks, split = [], kernels._split_state

    def spy(n_pairs, device, walk=False, **params):
        walks.append(walk)
        return split(n_pairs, device, walk, **params)

    monkeypatch.setattr(kernels, "_split_state", spy)
    launched = _builds(monkeypatch, kernels.seq_tables, "seq_tables")
    kw, args = _case(1, 2000, 4, 64, torch.bfloat16, [0, 300, 800, 1500, 2000], True, seed=9)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o1, ht1 = kernels.chunk_gdr_fwd_hopper(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    o2, ht2 = kernels.chunk_gdr_fwd_hopper(*args)
    assert len(launched) == 1 and walks == [False, True], (launched, walks)
    ref_o, ref_ht = recurrent_gdr_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5,
                                            initial_state=kw["initial_state"], output_final_state=True,
                                            cu_seqlens=kw["cu_seqlens"])
    assert rel_err(o1, ref_o) <= TOL and rel_err(ht1, ref_ht) <= TOL
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)


def test_varlen_tables_once_per_tensor_and_inference_mode(monkeypatch):
    """The chunk tables of a cu_seqlens tensor are built once outside CUDA-graph capture (again after an in-place
    change), every time inside it; a cu_seqlens made under torch.inference_mode (no version counter) is neither
    cached nor an error. Every run meets the oracle."""
    kernels = _kernels()
    built = _builds(monkeypatch, kernels.seq_tables, "seq_tables",
                   lambda _: torch.cuda.is_current_stream_capturing())
    B, T, H, HV, dtype, cu, h0, l2 = CASES["varlen-1tok-empty-h0"]
    kw, args = _case(B, T, H, HV, dtype, cu, h0, l2, seed=11)
    ref_o, _ = recurrent_gdr_reference(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5,
                                       initial_state=kw["initial_state"], cu_seqlens=kw["cu_seqlens"])
    o1, _ = kernels.chunk_gdr_fwd_hopper(*args)
    o2, _ = kernels.chunk_gdr_fwd_hopper(*args)
    assert built == [False] and torch.equal(o1, o2) and rel_err(o1, ref_o) <= TOL
    kw["cu_seqlens"].add_(0)  # an in-place write: the tables are built again
    kernels.chunk_gdr_fwd_hopper(*args)
    assert built == [False] * 2
    o3, _ = replayed(lambda: kernels.chunk_gdr_fwd_hopper(*args))
    assert built == [False] * 2 + [True] and torch.equal(o3, o1)
    with torch.inference_mode():
        frozen = kw["cu_seqlens"].clone()
        o4, _ = kernels.chunk_gdr_fwd_hopper(*args[:7], frozen, *args[8:])
        kernels.chunk_gdr_fwd_hopper(*args[:7], frozen, *args[8:])
    assert built == [False] * 2 + [True] + [False] * 2 and torch.equal(o4, o1)


CP_CASES = {
    # name: (B, T, H, HV, dtype, cu_seqlens, h0, l2norm, context_parallel: piece length in chunks or None)
    "cp-varlen-gva4-h0": (1, 5000, 2, 8, torch.bfloat16, [0, 3000, 3001, 3700, 5000], True, False, 8),
    "cp-dense-fp16-l2norm": (2, 1500, 1, 2, torch.float16, None, False, True, 4),
    "cp-auto-1x4096": (1, 4096, 1, 4, torch.bfloat16, None, True, False, None),
    # every v-head its own keys: on chip, T~ only for the chunks the transitions run (forward._sparse_inverse)
    "cp-varlen-mha-h0": (1, 5000, 4, 4, torch.bfloat16, [0, 3000, 3001, 3700, 5000], True, False, 8),
    # and keys the forward normalises: the gate tables without reading K (kkt_inverse(unit_keys=True))
    "cp-dense-mha-fp16-l2norm": (2, 1500, 2, 2, torch.float16, None, False, True, 4),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_matches_fp64_oracle(name, path, monkeypatch):
    """Pieces of a sequence run in parallel from warm-up or exact transition states (``context_parallel``), over
    the pieces with the inverse on chip (walking them where none is short: ``cp-auto-1x4096``) or after
    ``kkt_inverse``."""
    kernels = _kernels()
    _force(monkeypatch, kernels, path)
    B, T, H, HV, dtype, cu, h0, l2, cp = CP_CASES[name]
    kw, args = _case(B, T, H, HV, dtype, cu, h0, l2, seed=len(name))
    lens = [T] * B if cu is None else [b - a for a, b in zip(cu, cu[1:])]
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    chunks = cp or kernels.chunking.piece_chunks(lens, HV, n_sm)
    assert chunks is not None and max(lens) > chunks * 64  # the case does split
    o, ht = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=cp)
    ref_o, ref_ht = recurrent_gdr_reference(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw.get("initial_state"),
        output_final_state=True, cu_seqlens=kw.get("cu_seqlens"), use_qk_l2norm_in_kernel=l2,
    )
    assert rel_err(o, ref_o) <= TOL, rel_err(o, ref_o)
    assert rel_err(ht, ref_ht) <= TOL, rel_err(ht, ref_ht)
    o1, ht1 = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=False)
    assert rel_err(o, o1) <= TOL and rel_err(ht, ht1) <= TOL


@pytest.mark.parametrize("name", ["cp-varlen-gva4-h0", "cp-varlen-mha-h0"])
@pytest.mark.parametrize("n_sub", [4, 3])
def test_context_parallel_sub_walks_match_fp64_oracle(name, n_sub, monkeypatch):
    """A forward alone walks each exact piece's transition in sub-walks (pieces of 8 chunks: 4 of 2 chunks, or 3 of
    3, 3 and 2) and composes their maps (``context_parallel.compose``): the output and final state as the float64
    oracle's and as the forward without sub-walks."""
    kernels = _kernels()
    B, T, H, HV, dtype, cu, h0, l2, cp = CP_CASES[name]
    kw, args = _case(B, T, H, HV, dtype, cu, h0, l2, seed=len(name))
    composed = _builds(monkeypatch, kernels.context_parallel, "compose")
    o1, ht1 = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=cp)
    assert not composed  # the rule: no sub-walks in pieces this short
    monkeypatch.setattr(kernels.chunking, "sub_walks", lambda *_: n_sub)
    o, ht = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=cp)
    assert composed, "no sub-walks ran"
    ref_o, ref_ht = recurrent_gdr_reference(
        kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw.get("initial_state"),
        output_final_state=True, cu_seqlens=kw.get("cu_seqlens"), use_qk_l2norm_in_kernel=l2,
    )
    assert rel_err(o, ref_o) <= TOL, rel_err(o, ref_o)
    assert rel_err(ht, ref_ht) <= TOL, rel_err(ht, ref_ht)
    assert rel_err(o, o1) <= TOL and rel_err(ht, ht1) <= TOL


@pytest.mark.parametrize("h_qk, path", [(1, None), (4, "onchip")])
def test_context_parallel_exact_transitions_for_long_keys(h_qk, path, monkeypatch):
    """|k| > 1 voids the warm-up bound: every piece then carries its exact transition M (with ``onchip`` and a
    qk-head per v-head, T~ then formed for every chunk after the gate tables alone)."""
    kernels = _kernels()
    if path:
        _force(monkeypatch, kernels, path)
    kw, args = _case(1, 2000, h_qk, 4, torch.bfloat16, None, True, seed=3)
    k = (kw["k"].float() * 1.5).to(torch.bfloat16)  # beta |k|^2 up to 2.25 > 2
    args = (args[0], k) + args[2:]
    o, ht = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=4)
    ref_o, ref_ht = recurrent_gdr_reference(
        kw["q"], k, kw["v"], kw["g"], kw["beta"], scale=128**-0.5, initial_state=kw["initial_state"],
        output_final_state=True,
    )
    assert rel_err(o, ref_o) <= TOL, rel_err(o, ref_o)
    assert rel_err(ht, ref_ht) <= TOL, rel_err(ht, ref_ht)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inverse_kernels_match_fp64(dtype, heads):
    """Both gate-free inverse kernels (``kkt_inverse``; ``kkt_inverse_tc`` with ``heads`` v-heads per CTA) on the same
    varlen chunks (four v-heads per qk-head), some keys long enough to raise the contraction flag: T~ of each against
    a float64 inverse of I + L~ on every chunk slot and v-head, gamma, the masked beta and the flags bit for bit
    equal between them."""
    kernels = _kernels()
    from qla_compile.kernels.forward import kkt_inverse

    kw, _ = _case(1, 700, 2, 8, dtype, [0, 1, 100, 164, 700], False, seed=3)
    k = kw["k"].float()
    k[0, 150:160] *= 1.6  # beta |k|^2 > 2 for some of these tokens
    k3 = k[0].to(dtype).contiguous()
    n_tok, h_v = k3.shape[0], 8
    _, _, _, spans = kernels._tables(kw["cu_seqlens"], 1, n_tok, k3.device)
    g = kw["g"].reshape(n_tok, h_v).float().contiguous()
    beta = kw["beta"].reshape(n_tok, h_v).float().contiguous()
    name = kernels._DTYPES[dtype]
    out = []
    for kernel in (kkt_inverse.kkt_inverse(dk=128, dtype=name), kkt_inverse.kkt_inverse_tc(dk=128, dtype=name,
                                                                                            heads=heads)):
        tables = kernels._chunk_tables(n_tok, 4, h_v, k3.device)
        kernel(k3, g, beta, spans, *tables)
        out.append(tables)
    n_slots = int(spans[:, 1].gt(0).sum())
    (tt_a, gb_a, bad_a), (tt_b, gb_b, bad_b) = out
    assert torch.equal(gb_a[:n_slots], gb_b[:n_slots]) and torch.equal(bad_a[:n_slots], bad_b[:n_slots])
    assert bool(bad_a[:n_slots].any()) and not bool(bad_a[:n_slots].all())
    eye = torch.eye(64, dtype=torch.float64, device="cuda")
    for s in range(n_slots):
        a, n = spans[s].tolist()
        kk = k3[a : a + n].double()
        for h in range(h_v):
            lt = torch.zeros(64, 64, dtype=torch.float64, device="cuda")
            lt[:n, :n] = torch.tril(beta[a : a + n, h, None].double() * (kk[:, h // 4] @ kk[:, h // 4].T), -1)
            ref = torch.linalg.inv(eye + lt)
            for tt in (tt_a, tt_b):
                assert rel_err(tt[s, h], ref) <= 1e-3, (s, h, rel_err(tt[s, h], ref))


@pytest.mark.parametrize("n_sub,listed", [(1, False), (1, True), (3, True)])
@pytest.mark.parametrize("long_keys", [False, True])
def test_transitions_match_fp64(long_keys, n_sub, listed):
    """``context_parallel.transitions``: E of every piece that passes its state on (from a zero state over its warm-up
    window, or the whole piece) and M where formed, against the float64 recurrence run over the same tokens; from the
    warm-up plan's work list or without one (CTAs by pair, the list's buffers garbage); with at most ``n_sub``
    sub-walks an exact piece's (of 4 chunks: 2, 2 and none; with long keys every pair is exact, so two of 2 chunks)
    composed by ``context_parallel.compose``."""
    kernels = _kernels()
    from qla_compile.kernels import context_parallel

    kw, args = _case(1, 1900, 2, 4, torch.bfloat16, [0, 1200, 1260, 1900], False, seed=5)
    k = (kw["k"].float() * (1.5 if long_keys else 1.0)).to(torch.bfloat16)  # beta |k|^2 up to 2.25: M everywhere
    g = kw["g"].clone()
    g[..., 1] = 0  # heads 0 (make_inputs) and 1 never decay: their M is always formed
    k3, v3 = k[0].contiguous(), kw["v"][0].contiguous()
    n_tok, h_v = v3.shape[0], v3.shape[1]
    cu_in = kw["cu_seqlens"]
    _, _, _, spans = kernels._tables(cu_in, 1, n_tok, k.device)
    tables = kernels._chunk_tables(n_tok, cu_in.numel() - 1, h_v, k.device)
    kernels._gate_inverse(k3, g, kw["beta"], spans, tables, "bfloat16")
    tt, gb, bad = tables
    lens = (cu_in[1:] - cu_in[:-1]).tolist()
    pieces = kernels._piece_tables(lens, 4, k.device)  # 256-token pieces
    n_p = pieces.order.numel()
    skip = torch.empty(n_p, h_v, device="cuda", dtype=torch.int32)
    # without a list its buffers hold garbage, which neither kernel may read
    i32 = dict(device="cuda", dtype=torch.int32)
    counts = torch.zeros(2, **i32) if listed else torch.full((2,), 1 << 20, **i32)
    pairs = torch.full((n_p * h_v,), -(1 << 20), **i32)
    context_parallel.warmup_plan()(gb, bad, pieces.offsets, pieces.final_fwd, skip, counts, pairs, int(listed))
    if not listed:
        assert counts.tolist() == [1 << 20] * 2 and bool((pairs == -(1 << 20)).all())
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert n_sub == 1 or min(n_sub, n_sm // (2 * int(counts[0]))) > 1  # the kernel's choice: sub-walks run
    n_slots = n_p * h_v + n_sm // 2
    e = torch.full((n_slots, 128, 128), float("nan"), device="cuda")
    m = torch.full_like(e, float("nan"))
    context_parallel.transitions(dk=128, dv=128, dtype="bfloat16")(k3, v3, tt, gb, pieces.cu, pieces.offsets, skip,
                                                                    counts, pairs, int(listed), n_sub, n_sm,
                                                                    2 * n_p * h_v + n_sm * listed, e, m)
    if n_sub > 1:
        context_parallel.compose(dk=128, dv=128)(e, m, counts, pairs, n_sub, n_sm, n_sm // 4)
    e, m = e[:n_p * h_v].view(n_p, h_v, 128, 128), m[:n_p * h_v].view(n_p, h_v, 128, 128)
    passing = skip[pieces.final_fwd == 0]  # the pieces that pass their state on
    assert bool((passing < 0).any()) and (long_keys or bool((passing >= 0).any()))  # M formed; a warm-up window
    eye = torch.eye(128, device="cuda", dtype=torch.float32).expand(1, h_v, 128, 128)
    checked = 0
    for p in range(n_p):
        if pieces.final_fwd[p]:
            continue
        t0, t1 = int(pieces.cu[p]), int(pieces.cu[p + 1])
        for h in range(h_v):
            s = int(skip[p, h])
            a = t0 + 64 * max(s, 0)
            sl = slice(a, t1)
            head = h // 2
            ref = recurrent_gdr_reference(kw["q"][:, sl, head:head + 1], k[:, sl, head:head + 1],
                                          v3[None, sl, h:h + 1], g[:, sl, h:h + 1], kw["beta"][:, sl, h:h + 1],
                                          scale=1.0, output_final_state=True)[1]
            assert rel_err(e[p, h], ref[0, 0]) <= TOL, (p, h, rel_err(e[p, h], ref[0, 0]))
            if s < 0:
                ref_m = recurrent_gdr_reference(kw["q"][:, sl, head:head + 1], k[:, sl, head:head + 1],
                                                torch.zeros_like(v3[None, sl, h:h + 1]), g[:, sl, h:h + 1],
                                                kw["beta"][:, sl, h:h + 1], scale=1.0,
                                                initial_state=eye[:, :1], output_final_state=True)[1]
                assert rel_err(m[p, h], ref_m[0, 0]) <= TOL, (p, h, rel_err(m[p, h], ref_m[0, 0]))
            checked += 1
    assert checked >= 8


def test_context_parallel_under_capture():
    """A captured call reuses the plan of an uncaptured call with the same cu_seqlens, and runs unsplit
    for a cu_seqlens it has not seen (reading it would synchronise)."""
    kernels = _kernels()
    _, args = _case(1, 4096, 1, 4, torch.bfloat16, [0, 4000, 4096], True)
    eager = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=8)
    torch.cuda.synchronize()
    seen = replayed(lambda: kernels.chunk_gdr_fwd_hopper(*args, context_parallel=8))
    unseen_args = list(args)
    unseen_args[7] = args[7].clone()
    unseen = replayed(lambda: kernels.chunk_gdr_fwd_hopper(*unseen_args, context_parallel=8))
    unsplit = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=False)
    assert all(torch.equal(a, b) for a, b in zip(seen, eager))
    assert all(torch.equal(a, b) for a, b in zip(unseen, unsplit))


def test_forward_alone_reads_lengths_only_where_it_may_split():
    """A forward alone on a CUDA cu_seqlens it has not seen synchronises with the host (to read the lengths) only
    where its shapes allow a context-parallel split (``chunking.may_split``)."""
    kernels = _kernels()
    for n_tok, split in ((900, False), (8192, True)):
        _, args = _case(1, n_tok, 1, 4, torch.bfloat16, [0, n_tok - 100, n_tok], True, seed=7)
        assert kernels.chunking.may_split(n_tok, 4) == split
        kernels.chunk_gdr_fwd_hopper(*args)  # kernels loaded, outside the check
        args = list(args)
        args[7] = args[7].cuda().clone()  # a tensor the length cache has not seen
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if split:
                with pytest.raises(RuntimeError):
                    kernels.chunk_gdr_fwd_hopper(*args)
            else:
                kernels.chunk_gdr_fwd_hopper(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


@pytest.mark.parametrize("path", PATHS)
def test_every_output_element_written(path, monkeypatch):
    """Outputs allocated inside the call are poisoned with NaN; none may survive."""
    kernels = _kernels()
    _force(monkeypatch, kernels, path)
    _, args = _case(1, 452, 2, 4, torch.bfloat16, [0, 1, 2, 130, 130, 194, 451, 452], True)
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(math.nan) if t.is_floating_point() else t.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(torch, "empty_like", lambda x, **k: poisoned(x.shape, dtype=k.get("dtype", x.dtype),
                                                                     device=x.device))
    o, ht = kernels.chunk_gdr_fwd_hopper(*args)
    assert not o.isnan().any() and not ht.isnan().any()
    _, args = _case(1, 2000, 2, 4, torch.bfloat16, [0, 1500, 1501, 2000], True)
    o, ht = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=4)  # pieces, E, M, their states: all poisoned
    assert not o.isnan().any() and not ht.isnan().any()
    # a qk-head per v-head: on chip, T~ of the chunks the transitions skip is never formed, nor read
    _, args = _case(1, 2000, 4, 4, torch.bfloat16, [0, 1500, 1501, 2000], True)
    o, ht = kernels.chunk_gdr_fwd_hopper(*args, context_parallel=4)
    assert not o.isnan().any() and not ht.isnan().any()


@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_replay_equals_eager(varlen):
    kernels = _kernels()
    cu = [0, 100, 101, 400] if varlen else None
    _, args = _case(1 if varlen else 2, 400 if varlen else 200, 2, 8, torch.bfloat16, cu, True)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kernels.chunk_gdr_fwd_hopper(*static)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = kernels.chunk_gdr_fwd_hopper(*static)
    _, fresh = _case(1 if varlen else 2, 400 if varlen else 200, 2, 8, torch.bfloat16, cu, True, seed=7)
    for dst, src in zip(static, fresh):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    o, ht = kernels.chunk_gdr_fwd_hopper(*fresh)
    torch.cuda.synchronize()
    assert torch.equal(o_g, o) and torch.equal(ht_g, ht)


def test_repeated_runs_bitwise_identical():
    kernels = _kernels()
    _, args = _case(1, 3000, 4, 16, torch.bfloat16, [0, 1000, 1001, 3000], True)
    first = kernels.chunk_gdr_fwd_hopper(*args)
    for _ in range(3):
        again = kernels.chunk_gdr_fwd_hopper(*args)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("n_seq", [9, 1500])
def test_launch_order_longest_first(n_seq):
    kernels = _kernels()
    gen = torch.Generator().manual_seed(n_seq)
    lens = torch.randint(0, 300, (n_seq,), generator=gen)
    lens[::3] = lens[1]  # ties
    lens[2] = 0
    cu_in = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda()
    cu, offsets, order, spans = kernels._tables(cu_in, 1, int(cu_in[-1]), cu_in.device)
    chunks = [-(-n // 64) for n in lens.tolist()]
    assert cu.tolist() == cu_in.tolist()
    assert offsets.tolist() == [0] + torch.tensor(chunks).cumsum(0).tolist()
    # every chunk slot's (first token, tokens), then (0, 0) up to the slot bound
    expect = [(int(cu_in[n]) + 64 * j, min(64, int(lens[n]) - 64 * j)) for n in range(n_seq) for j in range(chunks[n])]
    assert spans.shape == (int(cu_in[-1]) // 64 + n_seq, 2)
    assert [tuple(x) for x in spans.tolist()] == expect + [(0, 0)] * (spans.shape[0] - len(expect))
    # longest first (ties in index order) up to 1024 sequences, the identity past that
    expect = sorted(range(n_seq), key=lambda i: (-chunks[i], i)) if n_seq <= 1024 else list(range(n_seq))
    assert order.tolist() == expect


def test_warmup_plan_matches_a_loop():
    kernels = _kernels()
    from qla_compile.kernels import context_parallel

    gen = torch.Generator().manual_seed(0)
    h_qk, h_v, n_slots = 2, 4, 40
    # two sequences (22 and 11 chunks, both ending mid-chunk) cut every 8 chunks, then 20 padding rows
    offs = [0, 8, 16, 22, 30, 33]
    cu = [0, 512, 1024, 1024 + 6 * 64 - 10, 1910, 1910 + 3 * 64 - 30]
    n_tok = cu[-1] + 20
    k = torch.nn.functional.normalize(torch.randn(n_tok, h_qk, 128, generator=gen), dim=-1)
    beta = torch.rand(n_tok, h_v, generator=gen)
    k[600, 0] *= 3**0.5  # |k|^2 = 3: with beta 0.9 not a contraction (v-head 1), with beta 0.5 one (v-head 0)
    beta[600, 0], beta[600, 1] = 0.5, 0.9
    beta[1950, 2] = -0.1  # a negative beta in the last piece of sequence 2 (v-head 2)
    beta[2080, 3] = -1.0  # past cu[-1]: never read
    sums = -torch.rand(n_slots, h_v, generator=gen) * 6  # chunk gate sums in [-6, 0]
    sums[:, 3] = 0  # a head that never decays: always the exact transition
    gb = torch.zeros(n_slots, h_v, 2, 64)
    gb[:, :, 0, 63] = sums
    gb[33:] = float("nan")  # unused slots hold garbage: never read
    dev = dict(device="cuda", dtype=torch.int32)
    kb = k.bfloat16().float()
    # the contraction flags from kkt_inverse (the pieces taken as its sequences), against the host's
    tt2 = torch.empty(n_slots, h_v, 64, 64, device="cuda", dtype=torch.float16)
    gb2 = torch.empty(n_slots, h_v, 2, 64, device="cuda")
    bad = torch.full((n_slots, h_v), 7, **dev)  # unused slots hold garbage: never read
    spans = torch.zeros(n_slots, 2, **dev)
    for p in range(5):
        for c in range(offs[p], offs[p + 1]):
            first = cu[p] + (c - offs[p]) * 64
            spans[c] = torch.tensor([first, min(64, cu[p + 1] - first)])
    kernels._gate_inverse(k.cuda().bfloat16(), torch.zeros(n_tok, h_v, device="cuda"), beta.cuda(), spans,
                          (tt2, gb2, bad), "bfloat16")
    for p in range(5):
        for c in range(offs[p], offs[p + 1]):
            rows = slice(cu[p] + (c - offs[p]) * 64, min(cu[p] + (c - offs[p] + 1) * 64, cu[p + 1]))
            for h in range(h_v):
                b = beta[rows, h]
                flagged = bool((b < 0).any() or (b * kb[rows, h // 2].square().sum(-1) > 2).any())
                assert bool(bad[c, h]) == flagged, (c, h)
    assert bad[9, 1] and not bad[9, 0] and bad[30, 2] and int(bad[:33].ne(0).sum()) == 2
    last, only = [0, 0, 1, 0, 1], [0, 0, 0, 0, 0]  # the forward's and the backward's final pieces
    for final in (last, only):
        skip = torch.full((5, h_v), -7, **dev)
        counts, pairs = torch.zeros(2, **dev), torch.full((5 * h_v,), -7, **dev)
        context_parallel.warmup_plan()(gb.cuda(), bad, torch.tensor(offs, **dev), torch.tensor(final, **dev), skip,
                                       counts, pairs, 1)
        # the work list: every pair that passes its state on, the exact ones first, each once
        n_exact, n_other = counts.tolist()
        listed = pairs[:n_exact].tolist() + pairs[5 * h_v - n_other:].tolist()
        assert n_exact + n_other <= 5 * h_v and sorted(listed) == [
            p * h_v + h for p in range(5) for h in range(h_v) if not final[p]]
        assert all(skip[i // h_v, i % h_v] < 0 for i in listed[:n_exact])
        assert all(skip[i // h_v, i % h_v] >= 0 for i in listed[n_exact:])
        for p in range(5):
            rows = slice(cu[p], cu[p + 1])
            for h in range(h_v):
                b = beta[rows, h]
                contractive = bool((b >= 0).all() and (b * kb[rows, h // 2].square().sum(-1) <= 2).all())
                expect, total = -1, 0.0
                for c in reversed(range(offs[p], offs[p + 1])):  # the piece's last chunks
                    total += sums[c, h].item()
                    if total < -10:
                        expect = c - offs[p] if contractive else -1
                        break
                if final[p]:
                    expect = 1 << 30
                assert skip[p, h].item() == expect, (final, p, h)
    assert skip[1, 1] == -1 and skip[1, 0] >= 0 and skip[4, 2] == -1  # the non-contractions did count


def test_supported_and_rejected_inputs():
    kernels = _kernels()
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert kernels.hopper_supported(q, q, v)
    assert not kernels.hopper_supported(q.float(), q.float(), v.float())
    assert not kernels.hopper_supported(q[..., :64], q[..., :64], v)
    assert not kernels.hopper_supported(q, q, v[:, :, :3])
    g = torch.zeros(1, 64, 3, device="cuda")
    with pytest.raises(ValueError, match="g must have shape"):
        kernels.chunk_gdr_fwd_hopper(q, q, v, g, g, 1.0)
