"""Build the Hopper kernels ahead of time, and the prebuilt binaries installed with the package.

    python -m qla_compile.prebuild [--jobs N]                   # every variant into the kernel cache
    python -m qla_compile.prebuild --build-artifact [--jobs N]  # the same, packed into qla_compile/kernels/prebuilt/
    python -m qla_compile.prebuild --check                      # no compile: what the installed binaries lack

Compiling works on a CPU-only machine with nvcc (the target is the explicit ``sm_90a``); the kernel cache is
``$QLA_CACHE_DIR`` (default ``~/.cache/qla_compile``). ``--build-artifact`` builds from the kernel sources, not
from the installed prebuilt binaries: a variant already in the kernel cache under its key (a hash of its TIR,
TileLang version and target) is taken from there, so ``QLA_CACHE_DIR=$(mktemp -d)`` compiles every one afresh.
``--check`` loads every variant from the installed prebuilt binaries (unpacked into the kernel cache) and exits 1
listing each one a first call would compile instead: not among them, built from other kernel sources or for
another TileLang, or not loadable.
"""

import argparse
import concurrent.futures
import importlib
import os
import sys
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


def _kernel(module, kernel):
    return getattr(importlib.import_module(module), kernel)


def _label(module, kernel, params):
    from qla_compile.kernels._build import describe

    return f"{module.rsplit('.', 1)[1]}.{describe(kernel, params)}"


def _build(job):
    module, kernel, params = job
    start = time.time()
    fn = _kernel(module, kernel)
    fn(**params)
    return job, fn.key(**params), time.time() - start


def build(jobs: int, artifact: bool):
    """Every variant into the kernel cache with ``jobs`` parallel compiles; with ``artifact`` then packed into the
    prebuilt binaries."""
    import tilelang

    from qla_compile.kernels import TARGET, _prebuilt, cache_dir

    if artifact:
        os.environ["QLA_PREBUILT"] = "0"  # the workers inherit it: from the sources, not the installed binaries
    variants = all_variants()
    print(f"building {len(variants)} kernel variants for sm_90a into {cache_dir()}")
    start = time.time()
    built = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for (module, kernel, params), key, seconds in pool.map(_build, variants):
            print(f"  {_label(module, kernel, params)}: {seconds:.1f} s")
            built.append(dict(module=module, kernel=kernel, params=params, key=key,
                              entry=os.path.join(cache_dir(), "kernels", key)))
    print(f"done in {time.time() - start:.1f} s")
    if artifact:
        _prebuilt.write(built, tilelang.__version__, TARGET)
        size = os.path.getsize(os.path.join(_prebuilt.DIR, "kernels.tar.xz"))
        print(f"wrote {_prebuilt.DIR}: {len(built)} variants, {size / 1e6:.2f} MB")


def check() -> int:
    """0 when every variant loads from the installed prebuilt binaries, else 1 after listing those a first call
    would compile, and why."""
    from qla_compile.kernels import _build, _prebuilt

    variants = all_variants()
    lacking = []
    for module, kernel, params in variants:
        prim = _kernel(module, kernel).factory(**params)
        key = _build.variant_key(kernel, params, prim)
        why = _prebuilt.why_not(key, kernel, params)
        if why is None:
            try:
                _build.load(_prebuilt.entry(key, _build.cache_dir()), prim)
            except Exception as exc:  # noqa: BLE001  (whatever keeps it from loading, a first call compiles it)
                why = f"its prebuilt binary does not load: {exc}"
        if why is not None:
            lacking.append(f"  {_label(module, kernel, params)}: {why}")
    if not lacking:
        print(f"all {len(variants)} kernel variants load from the prebuilt binaries ({_prebuilt.DIR})")
        return 0
    print(f"{len(lacking)} of {len(variants)} kernel variants do not load from the prebuilt binaries "
          f"({_prebuilt.DIR}); a first call compiles them:")
    print("\n".join(lacking))
    print(f"refresh them: {_prebuilt.REFRESH}")
    return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--build-artifact", action="store_true",
                      help="then pack every variant into the prebuilt binaries (qla_compile/kernels/prebuilt/)")
    mode.add_argument("--check", action="store_true",
                      help="compile nothing; exit 1 listing the variants that do not load from the prebuilt binaries")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = ap.parse_args(argv)
    if args.check:
        return check()
    build(args.jobs, args.build_artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
