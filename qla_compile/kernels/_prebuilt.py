"""The prebuilt sm_90a binaries of every kernel variant, installed with the package in ``prebuilt/`` beside this
file and made from the kernel sources by ``python -m qla_compile.prebuild --build-artifact``:

* ``manifest.json`` -- the TileLang version and target they were built for, the archive's sha256, the kernel
  sources' sha256 (:func:`sources_sha256`), per variant its module, kernel, params (defaults filled in) and key
  (``_build.variant_key``), and per kernel its params' defaults;
* ``kernels.tar.xz`` -- one directory per key, as ``_build.save`` writes it.

The archive is unpacked on first use into ``<kernel cache>/prebuilt/<its sha256>/``, once per machine and
archive (it is renamed into place whole, so concurrent processes never see half of it).

A variant is found in two ways: by its key (:func:`why_not`), which needs TileLang and the variant's TIR, or,
when the installed kernel sources and TileLang are those the manifest lists, by its kernel and params alone
(:func:`listed_key`: ``_build.kernel``'s fast path, which needs neither).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import json
import lzma
import os
import shutil
import tarfile
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.join(_HERE, "prebuilt")
FILES = ("device_kernel.cu", "executable.so", "params.json")
REFRESH = "python -m qla_compile.prebuild --build-artifact"
# the kernel modules: they generate the TIR and declare their variants (``variants()``)
KERNEL_MODULES = (
    "qla_compile.kernels.kkt_inverse",
    "qla_compile.kernels.seq_tables",
    "qla_compile.kernels.chunk_recurrence",
    "qla_compile.kernels.split_state_recurrence",
    "qla_compile.kernels.context_parallel",
    "qla_compile.kernels.reverse_recurrence",
    "qla_compile.kernels.chunk_grads",
)
# every file whose bytes can change a kernel's TIR, in the order sources_sha256 reads them
SOURCES = tuple(m.rsplit(".", 1)[1] + ".py" for m in KERNEL_MODULES) + ("chunking.py", "tile_inverse.py", "_build.py")


def _manifest_path():
    return os.path.join(DIR, "manifest.json")


def _archive_path():
    return os.path.join(DIR, "kernels.tar.xz")


def manifest() -> dict | None:
    """The installed manifest, or None when no prebuilt binaries are installed."""
    try:
        with open(_manifest_path()) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


@functools.cache
def sources_sha256() -> str:
    """The sha256 of the installed kernel sources: each of :data:`SOURCES` in turn, its name, size and bytes."""
    digest = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            data = f.read()
        digest.update(f"{name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def sources_mismatch(m: dict) -> str | None:
    """None when the manifest ``m`` was written from the installed kernel sources, else what to do about it."""
    if m.get("sources_sha256") == sources_sha256():
        return None
    return f"the kernel sources are not those the prebuilt binaries were built from; refresh them: {REFRESH}"


def listed_key(module: str, name: str, params: dict) -> tuple[str | None, str | None]:
    """``(key, None)`` when the prebuilt binaries hold kernel ``name`` of ``module`` with ``params`` for the
    installed kernel sources and TileLang (checked without importing TileLang or making TIR), else ``(None, why
    not)``."""
    m = manifest()
    if m is None:
        return None, f"no prebuilt binaries are installed in {DIR}"
    why = sources_mismatch(m)
    if why is not None:
        return None, why
    try:
        version = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        return None, "TileLang is not installed"
    if version != m["tilelang"]:
        return None, f"the prebuilt binaries are for TileLang {m['tilelang']}, this is {version}"
    params = {**m.get("defaults", {}).get(f"{module}.{name}", {}), **params}  # as listed: defaults filled in
    for v in m["variants"]:
        if (v["module"], v["kernel"], v["params"]) == (module, name, params):
            return v["key"], None
    return None, "it is not among the prebuilt variants"


def reusable(key: str, cache: str) -> str | None:
    """The directory of the prebuilt variant ``key`` (unpacked under the kernel cache directory ``cache``) when the
    installed binaries hold it, else None."""
    m = manifest()
    if m is None or not any(v["key"] == key for v in m["variants"]):
        return None
    return entry(key, cache)


def why_not(key: str, name: str, params: dict) -> str | None:
    """None when the prebuilt binaries hold the variant ``key`` (kernel ``name`` with ``params``), else why not."""
    import tilelang

    m = manifest()
    if m is None:
        return f"no prebuilt binaries are installed in {DIR}"
    if any(v["key"] == key for v in m["variants"]):
        return None
    if m["tilelang"] != tilelang.__version__:
        return f"the prebuilt binaries are for TileLang {m['tilelang']}, this is {tilelang.__version__}"
    if any(v["kernel"] == name and v["params"] == params for v in m["variants"]):
        return f"its prebuilt binary was built from other kernel sources or build settings (refresh them: {REFRESH})"
    return "it is not among the prebuilt variants"


def entry(key: str, cache: str) -> str:
    """The directory of the prebuilt variant ``key``, unpacking the archive under the kernel cache directory
    ``cache`` the first time."""
    root = os.path.join(cache, "prebuilt", manifest()["archive_sha256"][:16])
    if not os.path.isdir(root):
        _unpack(root)
    return os.path.join(root, key)


def _unpack(root):
    with open(_archive_path(), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != manifest()["archive_sha256"]:
        raise ValueError(f"{_archive_path()} is not the archive its manifest lists")
    os.makedirs(os.path.dirname(root), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".unpack-", dir=os.path.dirname(root))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        try:
            os.rename(staging, root)
        except OSError:
            if not os.path.isdir(root):  # else another process unpacked it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write(variants: list[dict], tilelang_version: str, target: dict, sources: str, defaults: dict):
    """Pack the entry directories of ``variants`` (dicts of module, kernel, params, key and entry) into the
    archive and write the manifest (``sources``: :func:`sources_sha256` of the sources they were built from;
    ``defaults``: each ``module.kernel``'s param defaults), both byte for byte the same for the same entries."""
    variants = sorted(variants, key=lambda v: (v["module"], v["kernel"], json.dumps(v["params"], sort_keys=True)))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for v in variants:
            for name in FILES:
                with open(os.path.join(v["entry"], name), "rb") as f:
                    data = f.read()
                info = tarfile.TarInfo(f"{v['key']}/{name}")
                info.size, info.mode = len(data), 0o755 if name.endswith(".so") else 0o644
                tar.addfile(info, io.BytesIO(data))
    archive = lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    os.makedirs(DIR, exist_ok=True)
    with open(_archive_path(), "wb") as f:
        f.write(archive)
    listed = [{k: v[k] for k in ("module", "kernel", "params", "key")} for v in variants]
    with open(_manifest_path(), "w") as f:
        json.dump({"tilelang": tilelang_version, "target": target, "sources_sha256": sources,
                   "archive_sha256": hashlib.sha256(archive).hexdigest(), "defaults": defaults, "variants": listed},
                  f, indent=1, sort_keys=True)
        f.write("\n")
