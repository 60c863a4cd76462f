"""What forming the q/k L2 norm's backward in ``chunk_grads`` costs the Hopper backward, on the GPU machine.

``chunk_gdr_bwd_hopper`` on L2-normalised q, k with the forward's aux, without and with ``rstd`` (the norm's
backward then formed in the kernel's store of dq, dk), T = 8192, bf16, per (qk-heads, v-heads): CUDA-graph
medians of 5 calls per replay. Timing only: the folded gradients are checked against the float64 oracle by
``tests/gpu/test_bwd_hopper.py``.

    python bench/l2norm_fold.py
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qla_compile.kernels import backward, chunk_gdr_fwd_hopper_aux  # noqa: E402
from qla_compile.kernels import input_activations as acts  # noqa: E402


def graph_ms(fn, reps=15):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 5)
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    scale = 128 ** -0.5
    for hk, hv in ((32, 32), (16, 32), (16, 16)):
        T = 8192
        q = torch.randn(1, T, hk, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn(1, T, hv, 128, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(1, T, hv, device="cuda") * 0.1
        beta = torch.rand(1, T, hv, device="cuda")
        (qn, kn), rstd, _ = acts.l2norm(q, k)
        o, _, tt, gb, _, cache = chunk_gdr_fwd_hopper_aux(qn, kn, v, g, beta, scale, None, None)
        do = torch.randn_like(o)

        def bwd(**fold):
            return backward.chunk_gdr_bwd_hopper(do, None, qn, kn, v, g, beta, scale, aux=(tt, gb, cache), **fold)

        plain, folded, again = graph_ms(bwd), graph_ms(lambda: bwd(rstd=rstd)), graph_ms(bwd)
        print(f"hk={hk} hv={hv}: plain {plain:.3f} / {again:.3f} ms, folded {folded:.3f} ms, "
              f"diff {folded - min(plain, again):+.3f}", flush=True)


if __name__ == "__main__":
    main()
