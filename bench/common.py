"""Inputs and CUDA-graph timing shared by the device benchmarks."""

import os
import statistics
import time

import torch
import torch.nn.functional as F


def parse_seqs(spec: str) -> list[int]:
    """'1x32768' -> [32768]; '8192x4' -> [8192]*4; '28672+4096' -> [28672, 4096]; '8192+128x60' -> [8192] + [128]*60."""
    if "+" in spec:
        return [n for part in spec.split("+") for n in parse_seqs(part)]
    if "x" not in spec:
        return [int(spec)]
    a, b = (int(s) for s in spec.split("x"))
    return [b] if a == 1 else [a] * b


def parse_row(spec: str) -> tuple[int, int, list[int]]:
    """A benchmark row '16/64:512x64' -> (H_qk, H_v, sequence lengths) = (16, 64, [512] * 64)."""
    heads, seqs = spec.split(":")
    h_qk, h_v = (int(h) for h in heads.split("/"))
    return h_qk, h_v, parse_seqs(seqs)


def make_inputs(h_qk, h_v, lens, dtype=torch.bfloat16, dk=128, dv=128, device="cuda", seed=0):
    """FlashQLA-style inputs, packed varlen (B = 1): L2-normalised q/k, g = logsigmoid(N(0,1))/16
    with every fourth head zero-decay, beta = sigmoid(N(0,1)) fp32, random fp32 h0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n_tok = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q = F.normalize(randn(1, n_tok, h_qk, dk), dim=-1).to(dtype)
    k = F.normalize(randn(1, n_tok, h_qk, dk), dim=-1).to(dtype)
    v = randn(1, n_tok, h_v, dv).to(dtype)
    g = F.logsigmoid(randn(1, n_tok, h_v)) / 16
    g[..., ::4] = 0
    beta = torch.sigmoid(randn(1, n_tok, h_v))
    h0 = randn(len(lens), h_v, dk, dv)
    cu = torch.tensor([0] + lens, device=device).cumsum(0)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu, scale=dk**-0.5)


# seconds of back-to-back replays before the timed ones in :func:`time_graph`: the clocks a sustained load settles at
# (power capping) rather than those of a GPU that was idle a moment ago; 0 (default) times right away
HOT_S = float(os.environ.get("QLA_BENCH_HOT_S", "0"))


def set_shortest_sub_walk(chunks):
    """The forward's exact CP transitions in sub-walks of at least ``chunks`` chunks from now on (0: none), whatever
    ``chunking.MIN_SUB_WALK_CHUNKS`` was; the device still picks how many run."""
    from qla_compile.kernels import chunking

    chunking.MIN_SUB_WALK_CHUNKS = chunks or 1 << 30  # longer than any piece: one walk


def time_graph(fn, reps=20, rounds=5):
    """Median milliseconds of one call of ``fn`` replayed from a CUDA graph (after ``QLA_BENCH_HOT_S`` seconds of
    replays, :data:`HOT_S`)."""
    graph = capture_graph(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    hot_until = time.time() + HOT_S
    while time.time() < hot_until:
        graph.replay()
        torch.cuda.synchronize()
    return statistics.median([replay_ms(graph, reps) for _ in range(rounds)])


def replay_ms(graph, reps):
    """Milliseconds of one of the ``reps`` calls a CUDA graph holds, from one replay timed by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def capture_graph(fn, reps):
    """A CUDA graph of ``reps`` calls of ``fn`` (after one eager call and one on a side stream)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def host_median_us(step, calls, rounds=5):
    """Median us of host time per call of ``step``: ``calls`` back to back per round, after ``calls // 10`` warm-up
    calls."""
    for _ in range(calls // 10):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def write_host_rows(out, name, rows, **meta):
    """Write ``rows`` of a host-time measurement to ``out/latest-{name}.json`` with the machine's facts (and
    ``meta``); print those."""
    import datetime
    import json
    import os
    import platform

    meta = dict(date=datetime.date.today().isoformat(), cpu=platform.processor() or platform.machine(),
                python=platform.python_version(), torch=torch.__version__, **meta, threads=torch.get_num_threads())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"latest-{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(meta)


def write_results(out, filename, rows):
    """``rows`` with the :func:`versions` of this run to ``out/filename`` (JSON)."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, filename), "w") as f:
        json.dump(dict(versions=versions(), rows=rows), f, indent=1)


def rel_l2(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def oracle_errors(o, x, lens, l2norm=False, prefix=2048):
    """``{n: rel_l2}`` of the output ``o`` of the :func:`make_inputs` ``x`` (sequence lengths ``lens``) against the
    float64 recurrence, on the first and last sequences, a prefix of at most ``prefix`` tokens each (from their
    initial states; ``l2norm``: the oracle normalises q and k)."""
    from qla_compile.reference import recurrent_gdr_reference

    cu, errors = x["cu"].tolist(), {}
    for n in sorted({0, len(lens) - 1}):
        a, t = cu[n], min(lens[n], prefix)
        sl = slice(a, a + t)
        ref_o, _ = recurrent_gdr_reference(
            x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["g"][:, sl], x["beta"][:, sl], scale=x["scale"],
            initial_state=x["h0"][n : n + 1], output_final_state=True, cu_seqlens=torch.tensor([0, t], device=o.device),
            use_qk_l2norm_in_kernel=l2norm)
        errors[n] = rel_l2(o[:, sl], ref_o)
    return errors


def ab_row(forward, target, attr, arms, x, lens, l2norm=False):
    """One row of a same-process A/B of ``forward()`` (o and the final state) on the :func:`make_inputs` ``x``: for
    each ``(name, value)`` of the two ``arms``, with ``target.attr`` set to ``value`` (restored after), its CUDA-graph
    median ``NAME_us`` and its o against the float64 oracle (:func:`oracle_errors`: ``NAME_o_vs_fp64_seqN``); then
    the second arm's o and final state against the first's (``o_B_vs_A``, ``ht_B_vs_A``) and ``speedup`` (A / B)."""
    row, outs, kept = {}, {}, getattr(target, attr)
    try:
        for name, value in arms:
            setattr(target, attr, value)
            outs[name] = [t.clone() for t in forward()]
            row[name + "_us"] = time_graph(forward) * 1e3
            for n, err in oracle_errors(outs[name][0], x, lens, l2norm).items():
                row[f"{name}_o_vs_fp64_seq{n}"] = err
    finally:
        setattr(target, attr, kept)
    (a, _), (b, _) = arms
    row[f"o_{b}_vs_{a}"] = rel_l2(outs[b][0], outs[a][0])
    row[f"ht_{b}_vs_{a}"] = rel_l2(outs[b][1], outs[a][1])
    row["speedup"] = row[a + "_us"] / row[b + "_us"]
    return row


def ab_cells(r, a, b):
    """The markdown cells of an :func:`ab_row` row ``r`` of arms ``a``, ``b``: the row, both times (us), the speedup,
    each arm's largest error against float64, b's o and final state against a's."""
    ea = max(v for k, v in r.items() if k.startswith(a + "_o_vs"))
    eb = max(v for k, v in r.items() if k.startswith(b + "_o_vs"))
    return (f"| {r['row']} | {r[a + '_us']:.1f} | {r[b + '_us']:.1f} | {r['speedup']:.3f} | {ea:.1e} / {eb:.1e} | "
            f"{r[f'o_{b}_vs_{a}']:.1e}, {r[f'ht_{b}_vs_{a}']:.1e} |")


def versions():
    """Versions of torch, the GPU and every implementation, for the results files."""
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for mod in ("tilelang", "fla", "flash_qla", "flashinfer", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a peer that does not import is reported as missing
            out[mod] = "missing"
    return out
