"""Build the Hopper kernels ahead of time, and the prebuilt binaries installed with the package.

    python -m qla_compile.prebuild [--jobs N]                   # every variant into the kernel cache
    python -m qla_compile.prebuild --build-artifact [--jobs N]  # the same, packed into qla_compile/kernels/prebuilt/
    python -m qla_compile.prebuild --check                      # no compile: what the installed binaries lack

Compiling works on a CPU-only machine with nvcc (the target is the explicit ``sm_90a``); the kernel cache is
``$QLA_CACHE_DIR`` (default ``~/.cache/qla_compile``). ``--build-artifact`` builds from the kernel sources: a
variant whose key (a hash of its TIR, TileLang version and target) the installed prebuilt binaries hold is that
same binary and is taken from them, one the kernel cache holds from there, and only the rest are compiled; so a
refresh after an edit that leaves the TIR alone (a comment, host code) compiles nothing. It also writes the kernel
sources' hash into the manifest, which lets a first call load the binaries without TileLang (``_build.kernel``).
``--check`` loads every variant from the installed prebuilt binaries (unpacked into the kernel cache) and exits 1
listing each one a first call would compile instead (not among them, built from other kernel sources or for
another TileLang, or not loadable), or when the manifest's sources hash is not the installed sources' (the fast
path is off).
"""

import argparse
import concurrent.futures
import functools
import importlib
import os
import sys
import time


def all_variants():
    """``(module, kernel name, params)`` for every kernel module that declares ``variants()``, the params with the
    factory's defaults filled in (as the variant's key has them)."""
    from qla_compile.kernels import _prebuilt
    from qla_compile.kernels._build import full_params

    out = []
    for name in _prebuilt.KERNEL_MODULES:
        module = importlib.import_module(name)
        out += [(name, kernel, full_params(getattr(module, kernel).factory, params))
                for kernel, params in getattr(module, "variants", list)()]
    return out


def _kernel(module, kernel):
    return getattr(importlib.import_module(module), kernel)


def _label(module, kernel, params):
    from qla_compile.kernels._build import describe

    return f"{module.rsplit('.', 1)[1]}.{describe(kernel, params)}"


def _build(job, reuse=False):
    """``(job, key, entry, reused, seconds)``: the variant ``job`` built into the kernel cache (``entry`` its
    directory there), or with ``reuse`` taken from the installed prebuilt binaries when they hold its key."""
    from qla_compile.kernels import _prebuilt, cache_dir

    module, kernel, params = job
    start = time.time()
    fn = _kernel(module, kernel)
    key = fn.key(**params)
    entry = _prebuilt.reusable(key, cache_dir()) if reuse else None
    reused = entry is not None
    if not reused:
        fn(**params)
        entry = os.path.join(cache_dir(), "kernels", key)
    return job, key, entry, reused, time.time() - start


def build(jobs: int, artifact: bool):
    """Every variant into the kernel cache with ``jobs`` parallel compiles; with ``artifact`` then packed into the
    prebuilt binaries, reusing the installed ones whose keys match."""
    import tilelang

    from qla_compile.kernels import TARGET, _prebuilt, cache_dir
    from qla_compile.kernels._build import defaults as factory_defaults

    if artifact:
        os.environ["QLA_PREBUILT"] = "0"  # the workers inherit it: a key not reused comes from the cache or nvcc
    variants = all_variants()
    print(f"building {len(variants)} kernel variants for sm_90a into {cache_dir()}")
    start = time.time()
    built = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for (module, kernel, params), key, entry, reused, seconds in pool.map(
                functools.partial(_build, reuse=artifact), variants):
            how = "the installed prebuilt binary" if reused else f"{seconds:.1f} s"
            print(f"  {_label(module, kernel, params)}: {how}")
            built.append(dict(module=module, kernel=kernel, params=params, key=key, entry=entry, reused=reused))
    print(f"done in {time.time() - start:.1f} s ({sum(b['reused'] for b in built)} reused)")
    if artifact:
        defaults = {f"{b['module']}.{b['kernel']}": factory_defaults(_kernel(b["module"], b["kernel"]).factory)
                    for b in built}
        _prebuilt.write(built, tilelang.__version__, TARGET, _prebuilt.sources_sha256(), defaults)
        size = os.path.getsize(os.path.join(_prebuilt.DIR, "kernels.tar.xz"))
        print(f"wrote {_prebuilt.DIR}: {len(built)} variants, {size / 1e6:.2f} MB")


def check() -> int:
    """0 when every variant loads from the installed prebuilt binaries, also without TileLang, else 1 after listing
    those a first call would compile, and why, or saying why the fast path (``_build.kernel``) is off."""
    from qla_compile.kernels import _build, _prebuilt

    variants = all_variants()
    m = _prebuilt.manifest()
    off = None if m is None else _prebuilt.sources_mismatch(m)
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
        if why is None and off is None:
            fast, why = _build.load_direct(module.rsplit(".", 1)[1], kernel, params)
            why = None if fast is not None else f"it loads, but not without TileLang: {why}"
        if why is not None:
            lacking.append(f"  {_label(module, kernel, params)}: {why}")
    if lacking:
        print(f"{len(lacking)} of {len(variants)} kernel variants do not load from the prebuilt binaries "
              f"({_prebuilt.DIR}) as a first call would:")
        print("\n".join(lacking))
    if off is not None:
        print(f"the fast path is off: {off}")
    elif lacking:
        print(f"refresh them: {_prebuilt.REFRESH}")
    else:
        print(f"all {len(variants)} kernel variants load from the prebuilt binaries ({_prebuilt.DIR}), "
              f"without TileLang's import too")
        return 0
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
