"""The prebuilt sm_90a binaries of every kernel variant, installed with the package in ``prebuilt/`` beside this
file and made from the kernel sources by ``python -m qla_compile.prebuild --build-artifact``:

* ``manifest.json`` -- the TileLang version and target they were built for, the archive's sha256 and, per
  variant, its module, kernel, params and key (``_build.variant_key``);
* ``kernels.tar.xz`` -- one directory per key, as ``_build.save`` writes it.

The archive is unpacked on first use into ``<kernel cache>/prebuilt/<its sha256>/``, once per machine and
archive (it is renamed into place whole, so concurrent processes never see half of it).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import shutil
import tarfile
import tempfile

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prebuilt")
FILES = ("device_kernel.cu", "executable.so", "params.json")
REFRESH = "python -m qla_compile.prebuild --build-artifact"


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


def write(variants: list[dict], tilelang_version: str, target: dict):
    """Pack the entry directories of ``variants`` (dicts of module, kernel, params, key and entry) into the
    archive and write the manifest, both byte for byte the same for the same entries."""
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
        json.dump({"tilelang": tilelang_version, "target": target,
                   "archive_sha256": hashlib.sha256(archive).hexdigest(), "variants": listed},
                  f, indent=1, sort_keys=True)
        f.write("\n")
