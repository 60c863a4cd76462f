"""CPU check of a tensor-core form of kkt_inverse's T~ = (I + L)^-1 (issue 20's next step), against float64.

The blocked form: the four 16x16 diagonal blocks inverted by fp32 substitution, then two doubling levels on tensor
cores with fp16 operands and fp32 accumulation (A^-1 = [[D0, 0], [-D1 L10 D0, D1]] for each 32-block, then
T~21 = -B^-1 C A^-1), each product's output rounded to fp16 before it is an operand again. The committed form
(``kkt_inverse``): the two 32x32 diagonal blocks and X = B^-1 C by fp32 substitution, one fp16 product -X A^-1.
Both end in fp16 T~. Inputs: the tests' (``tests/gdn_inputs.py``: unit keys, beta in [0, 1]) and keys crowded
around one direction (the hardest case for an fp16 product chain).

    python bench/blocked_inverse_precision.py
"""

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from bench.common import rel_l2  # noqa: E402
from gdn_inputs import make_inputs  # noqa: E402

F64 = torch.float64


def fp16(x):
    return x.to(torch.float16).to(F64)


def fp32_inverse(m):
    return torch.linalg.inv(m.float()).to(F64)


def blocked(L):
    """T~ by 16x16 fp32 diagonal inverses and two levels of fp16 products."""
    eye = torch.eye(16, dtype=F64)
    d = [fp32_inverse(eye + L[16 * b:16 * b + 16, 16 * b:16 * b + 16]) for b in range(4)]
    halves = []
    for p in (0, 2):  # the 32-blocks A (16-blocks 0, 1) and B (2, 3)
        y = (fp16(L[16 * p + 16:16 * p + 32, 16 * p:16 * p + 16]) @ fp16(d[p])).float().to(F64)
        inv = torch.zeros(32, 32, dtype=F64)
        inv[:16, :16], inv[16:, 16:], inv[16:, :16] = d[p], d[p + 1], -(fp16(d[p + 1]) @ fp16(y))
        halves.append(inv)
    a_inv, b_inv = halves
    z = (fp16(L[32:, :32]) @ fp16(a_inv)).float().to(F64)
    return _assemble(a_inv, b_inv, -(fp16(b_inv) @ fp16(z)))


def committed(L):
    """T~ as kkt_inverse forms it: 32x32 fp32 inverses and X = B^-1 C, then one fp16 product."""
    eye = torch.eye(32, dtype=F64)
    a_inv, b_inv = fp32_inverse(eye + L[:32, :32]), fp32_inverse(eye + L[32:, 32:])
    x = torch.linalg.solve((eye + L[32:, 32:]).float(), L[32:, :32].float()).to(F64)
    return _assemble(a_inv, b_inv, -(fp16(x) @ fp16(a_inv)))


def _assemble(a_inv, b_inv, t21):
    t = torch.zeros(64, 64, dtype=F64)
    t[:32, :32], t[32:, 32:], t[32:, :32] = a_inv, b_inv, t21
    return fp16(t)


def errors(ls):
    out = {"committed": [], "blocked": []}
    for L in ls:
        exact = torch.linalg.inv(torch.eye(64, dtype=F64) + L)
        out["committed"].append(rel_l2(committed(L), exact))
        out["blocked"].append(rel_l2(blocked(L), exact))
    return {name: (max(v), sum(v) / len(v)) for name, v in out.items()}


def main():
    ls = []
    for seed in range(4):
        kw = make_inputs(1, 512, 1, 1, 128, 128, seed=seed)
        k, beta = fp16(kw["k"][0, :, 0].to(F64)), kw["beta"][0, :, 0].to(F64)
        ls += [torch.tril(beta[c:c + 64, None] * (k[c:c + 64] @ k[c:c + 64].T), -1) for c in range(0, 512, 64)]
    print("| keys | committed max / mean | blocked max / mean |")
    print("|---|---|---|")
    rows = [("tests' inputs (32 chunks)", ls)]
    gen = torch.Generator().manual_seed(1)
    base = F.normalize(torch.randn(128, generator=gen, dtype=F64), dim=0)
    for noise in (0.5, 0.2, 0.05):
        k = fp16(F.normalize(base + noise * torch.randn(64, 128, generator=gen, dtype=F64), dim=-1))
        rows.append((f"crowded, noise {noise}, beta 1", [torch.tril(k @ k.T, -1)]))
    for label, group in rows:
        e = errors(group)
        print(f"| {label} | {e['committed'][0]:.2e} / {e['committed'][1]:.2e} | {e['blocked'][0]:.2e} / "
              f"{e['blocked'][1]:.2e} |")


if __name__ == "__main__":
    main()
