"""qla_compile in one minute: FLA's chunk_gated_delta_rule API, checked against a float64 oracle,
differentiated, and compiled once for many sequence lengths. Runs on a CPU in seconds."""
import time

import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx

import qla_compile
from qla_compile import dispatch

torch.manual_seed(0)
B, T, H, HV, K, V = 2, 300, 2, 4, 64, 64  # GVA: 4 value heads share 2 q/k heads
q = torch.randn(B, T, H, K, requires_grad=True)
k = torch.randn(B, T, H, K, requires_grad=True)
v = torch.randn(B, T, HV, V, requires_grad=True)
g = F.logsigmoid(torch.randn(B, T, HV)).requires_grad_()  # log forget gate
beta = torch.rand(B, T, HV, requires_grad=True)
h0 = torch.randn(B, HV, K, V, requires_grad=True)

for attempt in ("first call", "second call"):
    t0 = time.perf_counter()
    o, ht = qla_compile.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    print(f"forward ({dispatch.select(q, k, v)} on {q.device}, {attempt}): o {tuple(o.shape)}, "
          f"final state {tuple(ht.shape)} in {1e3 * (time.perf_counter() - t0):.1f} ms")

ro, rht = qla_compile.recurrent_gdr_reference(
    q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
)
err = ((o.double() - ro).norm() / ro.norm()).item()
print(f"relative L2 error vs the float64 per-token oracle: {err:.1e}")

(o.square().mean() + ht.square().mean()).backward()
print("gradients:", ", ".join(f"d{n} {tuple(x.grad.shape)}" for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items()))

graphs = []


def counting_inductor(gm, example_inputs):
    graphs.append(gm)
    return compile_fx(gm, example_inputs)


compiled = torch.compile(qla_compile.chunk_gated_delta_rule, backend=counting_inductor, fullgraph=True, dynamic=True)
for length in (100, 257, 300):
    args = [x.detach()[:, :length].contiguous() for x in (q, k, v, g, beta)]
    out, _ = compiled(*args, use_qk_l2norm_in_kernel=True)
    print(f"torch.compile(fullgraph=True, dynamic=True), T={length}: o {tuple(out.shape)}")
print(f"graphs compiled for the three lengths: {len(graphs)}")
