"""Build FlashQLA's TileLang kernels for the H200 (sm_90a) on a machine without a GPU, so that the benchmarks on the
lent H200 compile none of them (FlashQLA JIT-compiles 20-60 s per shape class, which the device's minutes cannot
afford, and `bench_fwd`'s `--flashqla-budget` otherwise leaves rows without FlashQLA).

FlashQLA's own host code runs on CPU tensors for every shape of `bench_fwd` and `bench_bwd`, under a stand-in for
`torch.cuda` that reports one H200 (compute 9.0, 132 SMs); TileLang detects the target from torch as it does on the
device (``{"kind": "cuda", "arch": "sm_90a"}``), so the kernel cache keys match; kernel launches are skipped. The
kernels land in ``TILELANG_CACHE_DIR``; carry that folder as a tar.xz and unpack it on the device into the
``TILELANG_CACHE_DIR`` the benchmarks run with. Needs FlashQLA and TileLang importable (e.g. the device bundle's
``flash_qla`` on ``PYTHONPATH``) and ``nvcc``. The cache is built from FlashQLA's code: never commit it.

    mkdir -p /tmp/sitex && tar xJf .devdeps/site.tar.xz -C /tmp/sitex ./flash_qla   # FlashQLA alone
    TILELANG_CACHE_DIR=/tmp/fq-cache PYTHONPATH=/tmp/sitex python bench/flashqla_cache.py [--fwd] [--bwd]
    tar cJf .carry/flashqla-cache.tar.xz -C /tmp/fq-cache .
"""
import argparse
import contextlib
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)


def stand_in_cuda():
    """torch.cuda as one H200 that runs nothing; TileLang's kernels compile and their launches are skipped."""
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.current_device = lambda: 0
    cuda.get_device_capability = lambda device=None: (H200.major, H200.minor)
    cuda.get_device_properties = lambda device=None: H200
    cuda.device = lambda device=None: contextlib.nullcontext()
    cuda.is_current_stream_capturing = lambda: False
    from tilelang.contrib import nvcc
    from tilelang.jit.kernel import JITKernel

    compute_version = nvcc.get_target_compute_version
    nvcc.get_target_compute_version = lambda target=None: compute_version(target) if target else "9.0"
    JITKernel.__call__ = lambda self, *args, **kwargs: None


def shapes(fwd, bwd):
    """(hk, hv, sequence lengths, with the backward) of the benchmarks' rows, each once."""
    from bench.bench_bwd import configs
    from bench.bench_fwd import HEADS, HEADS_WIDE, SEQS, SEQS_WIDE
    from bench.common import parse_seqs

    rows = []
    if fwd:
        rows += [(hk, hv, parse_seqs(s), False) for hk, hv in HEADS + HEADS_WIDE for s in SEQS + SEQS_WIDE]
    if bwd:
        rows += [(hk, hv, lens, True) for hk, hv, _, lens in configs(False)]
    seen, out = set(), []
    for hk, hv, lens, train in rows:
        if (hk, hv, tuple(lens), train) not in seen:
            seen.add((hk, hv, tuple(lens), train))
            out.append((hk, hv, lens, train))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fwd", action="store_true", help="bench_fwd's rows (default: both sets)")
    ap.add_argument("--bwd", action="store_true", help="bench_bwd's rows, forward and backward")
    args = ap.parse_args()
    fwd, bwd = (args.fwd, args.bwd) if args.fwd or args.bwd else (True, True)
    stand_in_cuda()
    import flash_qla

    from bench.common import make_inputs

    for hk, hv, lens, train in shapes(fwd, bwd):
        start = time.time()
        x = make_inputs(hk, hv, lens, device="cpu")
        leaves = [x[n].requires_grad_(train) for n in ("q", "k", "v", "g", "beta", "h0")]
        o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], scale=x["scale"], initial_state=leaves[5],
                                                 output_final_state=True, cu_seqlens=x["cu"])
        if train:
            torch.autograd.grad((o, ht), leaves, (torch.zeros_like(o), torch.zeros_like(ht)))
        print(f"{hk}/{hv} {len(lens)} sequences, {sum(lens)} tokens{' + backward' if train else ''}: "
              f"{time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
