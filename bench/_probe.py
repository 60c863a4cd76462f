"""Temporary device probe (not committed): chunk_gdr_bwd_hopper with and without the folded L2-norm backward."""
import os, sys, statistics
sys.path.insert(0, os.getcwd())
import torch
from qla_compile.kernels import backward, chunk_gdr_fwd_hopper_aux, input_activations as acts

def graph_ms(fn, reps=15):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 5)
    return statistics.median(ts)

torch.manual_seed(0)
for hk, hv in ((32, 32), (16, 32), (16, 16)):
    T = 8192
    q = torch.randn(1, T, hk, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(1, T, hv, 128, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, T, hv, device="cuda") * 0.1
    beta = torch.rand(1, T, hv, device="cuda")
    (qn, kn), rstd, _ = acts.l2norm(q, k)
    o, ht, tt, gb, _, cache = chunk_gdr_fwd_hopper_aux(qn, kn, v, g, beta, 128 ** -0.5, None, None)
    do = torch.randn_like(o)
    aux = (tt, gb, cache)
    plain = lambda: backward.chunk_gdr_bwd_hopper(do, None, qn, kn, v, g, beta, 128 ** -0.5, aux=aux)
    folded = lambda: backward.chunk_gdr_bwd_hopper(do, None, qn, kn, v, g, beta, 128 ** -0.5, aux=aux, rstd=rstd)
    a, b = graph_ms(plain), graph_ms(folded)
    a2 = graph_ms(plain)
    print(f"hk={hk} hv={hv}: plain {a:.3f} / {a2:.3f} ms, folded {b:.3f} ms, diff {b - min(a, a2):+.3f}", flush=True)
