"""Compile every Hopper kernel variant into the on-disk cache ahead of time.

    python -m qla_compile.prebuild [--jobs N]

Works on a CPU-only machine with nvcc (the target is the explicit ``sm_90a``). The cache goes to
``$QLA_CACHE_DIR`` (default ``~/.cache/qla_compile``); copy that directory to the GPU machine, or build
there, and the first call in a fresh process only loads the compiled kernels.
"""

import argparse
import concurrent.futures
import importlib
import os
import time

_MODULES = (
    "qla_compile.kernels.kkt_inverse",
    "qla_compile.kernels.seq_tables",
    "qla_compile.kernels.chunk_recurrence",
    "qla_compile.kernels.context_parallel",
    "qla_compile.kernels.reverse_recurrence",
    "qla_compile.kernels.chunk_grads",
)


def all_variants():
    """``(module, kernel name, params)`` for every kernel module that declares ``variants()``."""
    out = []
    for name in _MODULES:
        module = importlib.import_module(name)
        out += [(name, kernel, params) for kernel, params in getattr(module, "variants", list)()]
    return out


def _build(job):
    module, kernel, params = job
    start = time.time()
    getattr(importlib.import_module(module), kernel)(**params)
    return job, time.time() - start


def main(argv=None):
    from qla_compile.kernels import cache_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = ap.parse_args(argv)
    jobs = all_variants()
    print(f"compiling {len(jobs)} kernel variants for sm_90a into {cache_dir()}")
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for (module, kernel, params), seconds in pool.map(_build, jobs):
            print(f"  {module.rsplit('.', 1)[1]}.{kernel}({', '.join(f'{k}={v}' for k, v in params.items())}): {seconds:.1f} s")
    print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
