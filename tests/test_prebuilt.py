"""The prebuilt kernels on the CPU: variant keys follow the kernel sources and TileLang, the loader takes the
prebuilt binary, then the kernel cache, and compiles (logged, with why) only what neither holds; the launcher
(``_build.kernel``) loads a shipped binary without TileLang while the sources hash matches and falls back (logged)
when not; ``prebuild --check`` reports what the installed binaries lack, and ``--build-artifact`` reuses them.

The loader test compiles the small varlen table kernel twice (a few seconds each; needs nvcc); the rest compile
nothing.
"""
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "qla_compile.kernels.seq_tables"
PARAMS = dict(cu_dtype="int32")


@pytest.fixture
def tables():
    """``seq_tables`` with its memo cleared before and after (the tests change its source and the caches)."""
    from qla_compile.kernels import seq_tables

    seq_tables.seq_tables.cache_clear()
    yield seq_tables
    seq_tables.seq_tables.cache_clear()


@pytest.fixture
def launcher():
    """``_build.kernel`` with its memo cleared before and after."""
    from qla_compile.kernels import _build

    _build.kernel.cache_clear()
    yield _build.kernel
    _build.kernel.cache_clear()


def _write_manifest(directory, tilelang_version, variants, sources="", defaults=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps({"tilelang": tilelang_version, "target": {},
                                                         "archive_sha256": "", "sources_sha256": sources,
                                                         "defaults": defaults or {}, "variants": variants}))


def test_key_follows_kernel_source_params_and_tilelang(tables, monkeypatch):
    import tilelang

    key = tables.seq_tables.key(**PARAMS)
    assert tables.seq_tables.key(**PARAMS) == key
    assert tables.seq_tables.key(cu_dtype="int64") != key
    with monkeypatch.context() as m:
        m.setattr(tables, "_TABLE_BLOCK", 512)  # a kernel source change: other TIR
        assert tables.seq_tables.key(**PARAMS) != key
    with monkeypatch.context() as m:
        m.setattr(tilelang, "__version__", "0.0.1")
        assert tables.seq_tables.key(**PARAMS) != key
    assert tables.seq_tables.key(**PARAMS) == key


def test_why_not_names_the_reason(tables, tmp_path, monkeypatch):
    import tilelang

    from qla_compile.kernels import _prebuilt

    key = tables.seq_tables.key(**PARAMS)
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "none"))
    assert "no prebuilt binaries are installed" in _prebuilt.why_not(key, "seq_tables", PARAMS)
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    _write_manifest(tmp_path / "prebuilt", tilelang.__version__,
                    [dict(module=MODULE, kernel="seq_tables", params=PARAMS, key=key)])
    assert _prebuilt.why_not(key, "seq_tables", PARAMS) is None
    assert "other kernel sources" in _prebuilt.why_not("0" * 64, "seq_tables", PARAMS)
    assert "not among the prebuilt variants" in _prebuilt.why_not("0" * 64, "seq_tables", dict(cu_dtype="int64"))
    _write_manifest(tmp_path / "prebuilt", "0.0.1", [])
    assert "for TileLang 0.0.1" in _prebuilt.why_not(key, "seq_tables", PARAMS)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_loader_prebuilt_then_cache_then_compile(tables, tmp_path, monkeypatch, caplog):
    """A binary packed by ``_prebuilt.write`` loads in a fresh cache without a compile; after a kernel source
    change it is stale: not loaded, one logged compile into the kernel cache, which serves the next process."""
    import tilelang

    from qla_compile.kernels import TARGET, _prebuilt

    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    monkeypatch.delenv("QLA_PREBUILT", raising=False)
    caplog.set_level(logging.WARNING, logger="qla_compile")

    def call(cache):
        monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / cache))
        tables.seq_tables.cache_clear()
        caplog.clear()
        kernel = tables.seq_tables(**PARAMS)
        return kernel, [r.getMessage() for r in caplog.records]

    _, logs = call("build")
    assert len(logs) == 1 and "compiling the kernel seq_tables" in logs[0] and "no prebuilt binaries" in logs[0]
    key = tables.seq_tables.key(**PARAMS)
    _prebuilt.write([dict(module=MODULE, kernel="seq_tables", params=PARAMS, key=key,
                          entry=str(tmp_path / "build" / "kernels" / key))], tilelang.__version__, TARGET, "", {})

    kernel, logs = call("fresh")
    assert logs == [] and kernel.adapter.libpath.startswith(str(tmp_path / "fresh" / "prebuilt"))
    assert "__global__" in kernel.get_kernel_source()

    with monkeypatch.context() as m:
        m.setattr(tables, "_TABLE_BLOCK", 512)  # a kernel source change
        _, logs = call("fresh")
        assert len(logs) == 1 and "built from other kernel sources" in logs[0], logs
        kernel, logs = call("fresh")
        assert logs == [] and kernel.adapter.libpath.startswith(str(tmp_path / "fresh" / "kernels"))

    monkeypatch.setenv("QLA_PREBUILT", "0")
    _, logs = call("off")
    assert len(logs) == 1 and "QLA_PREBUILT=0" in logs[0], logs


def test_check_passes_with_the_installed_binaries(tmp_path, monkeypatch, capsys):
    """The committed binaries are those of the current kernel sources (else: ``prebuild --build-artifact``) and
    load."""
    from qla_compile import prebuild

    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    assert prebuild.main(["--check"]) == 0, capsys.readouterr().out


def test_check_lists_missing_and_stale_variants(tmp_path, monkeypatch, capsys):
    from qla_compile import prebuild
    from qla_compile.kernels import _prebuilt

    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(_prebuilt.DIR, tmp_path / "prebuilt")
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    manifest = json.loads((tmp_path / "prebuilt" / "manifest.json").read_text())
    dropped, stale = manifest["variants"][0], manifest["variants"][1]
    manifest["variants"] = manifest["variants"][1:]
    stale["key"] = "0" * 64
    manifest["sources_sha256"] = "0" * 64
    (tmp_path / "prebuilt" / "manifest.json").write_text(json.dumps(manifest))
    assert prebuild.main(["--check"]) == 1
    out = capsys.readouterr().out
    n = len(prebuild.all_variants())
    assert f"2 of {n} kernel variants do not load from the prebuilt binaries" in out, out
    assert f"{dropped['kernel']}(" in out and "not among the prebuilt variants" in out
    assert "built from other kernel sources" in out
    assert f"the fast path is off: the kernel sources are not those the prebuilt binaries were built from; " \
           f"refresh them: {_prebuilt.REFRESH}" in out

    (tmp_path / "prebuilt" / "kernels.tar.xz").write_bytes(b"not an archive")
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / "cache2"))
    assert prebuild.main(["--check"]) == 1
    assert "kernels.tar.xz is not the archive its manifest lists" in capsys.readouterr().out


def test_a_default_spelled_out_or_left_out_is_one_shipped_variant():
    """Variant keys hash the params with the factory's defaults filled in (on the H200 a call that left out a
    default its listed variant spelled out compiled instead of loading the shipped binary)."""
    pytest.importorskip("tilelang")
    from qla_compile.kernels import _prebuilt, chunk_grads, context_parallel

    shipped = {v["key"] for v in _prebuilt.manifest()["variants"]}
    key = context_parallel.scan.key(dk=128, dv=128, has_h0=False, reverse=False)
    assert key in shipped and context_parallel.scan.key(dk=128, dv=128, has_h0=False) == key
    assert context_parallel.scan.key(dk=128, dv=128, has_h0=False, reverse=True) != key
    for l2norm in (False, True):
        assert chunk_grads.chunk_grads.key(dk=128, dv=128, dtype="bfloat16", pdl=True, l2norm=l2norm) in shipped
    module = "qla_compile.kernels.context_parallel"
    assert _prebuilt.listed_key(module, "scan", dict(dk=128, dv=128, has_h0=False)) == (key, None)
    assert _prebuilt.listed_key(module, "scan", dict(dk=128, dv=128, has_h0=False, reverse=False)) == (key, None)


def test_listed_key_names_the_reason(tmp_path, monkeypatch):
    """The fast path's lookup: by kernel and params, only for the manifest's kernel sources and TileLang."""
    from qla_compile.kernels import _prebuilt

    version = importlib.metadata.version("tilelang")
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "none"))
    assert "no prebuilt binaries are installed" in _prebuilt.listed_key(MODULE, "seq_tables", PARAMS)[1]
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    listed = [dict(module=MODULE, kernel="seq_tables", params=PARAMS, key="1" * 64)]
    _write_manifest(tmp_path / "prebuilt", version, listed, _prebuilt.sources_sha256())
    assert _prebuilt.listed_key(MODULE, "seq_tables", PARAMS) == ("1" * 64, None)
    not_listed = "it is not among the prebuilt variants"
    assert _prebuilt.listed_key(MODULE, "seq_tables", dict(cu_dtype="int64"))[1] == not_listed
    with_default = [dict(module=MODULE, kernel="seq_tables", params=dict(PARAMS, extra=1), key="2" * 64)]
    _write_manifest(tmp_path / "prebuilt", version, with_default, _prebuilt.sources_sha256(),
                    defaults={f"{MODULE}.seq_tables": dict(extra=1)})
    assert _prebuilt.listed_key(MODULE, "seq_tables", PARAMS) == ("2" * 64, None)  # the default filled in
    assert _prebuilt.listed_key(MODULE, "seq_tables", dict(PARAMS, extra=1)) == ("2" * 64, None)
    assert _prebuilt.listed_key(MODULE, "seq_tables", dict(PARAMS, extra=2))[1] == not_listed
    _write_manifest(tmp_path / "prebuilt", "0.0.1", listed, _prebuilt.sources_sha256())
    assert f"for TileLang 0.0.1, this is {version}" in _prebuilt.listed_key(MODULE, "seq_tables", PARAMS)[1]
    _write_manifest(tmp_path / "prebuilt", version, listed, "0" * 64)
    assert "the kernel sources are not those" in _prebuilt.listed_key(MODULE, "seq_tables", PARAMS)[1]


def test_sources_hash_covers_what_the_tir_is_made_from():
    """Every kernel module and every package module they import is hashed."""
    import ast

    from qla_compile.kernels import _prebuilt

    here = os.path.dirname(_prebuilt.__file__)
    reached = set()
    for name in _prebuilt.KERNEL_MODULES:
        tree = ast.parse(open(os.path.join(here, name.rsplit(".", 1)[1] + ".py")).read())
        reached |= {f"{node.module or a.name}.py" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.level == 1 for a in node.names}
    assert reached | {m.rsplit(".", 1)[1] + ".py" for m in _prebuilt.KERNEL_MODULES} == set(_prebuilt.SOURCES)


def test_launcher_takes_a_shipped_binary_without_tilelang(tmp_path):
    """In a fresh process with the installed prebuilt binaries: the host code imports and decides without TileLang,
    and the launcher (and a kernel handle of the host code) loads a shipped variant into TVM-FFI without it."""
    script = f"""
import logging, sys
import torch
import qla_compile
from qla_compile import dispatch
from qla_compile.kernels import _build, forward
logging.basicConfig(level=logging.WARNING)
x = torch.zeros(1, 1, 1, 128)
assert dispatch._kernels() is forward and forward.unsupported(x, x, x) == "tensors on cpu, not CUDA"
fn = _build.kernel("seq_tables", "seq_tables", **{PARAMS!r})
assert forward.seq_tables.seq_tables(**{PARAMS!r}) is fn
print(type(fn).__module__, "tilelang" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QLA_", "TILELANG_"))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env=dict(env, QLA_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tvm_ffi.core", "False"] and "qla_compile" not in proc.stderr, proc.stderr


def test_launcher_falls_back_when_the_sources_changed(tables, launcher, tmp_path, monkeypatch, caplog):
    """With a manifest whose sources hash is not the installed sources', the launcher logs why and takes the
    variant by its TIR's key: here the same prebuilt binary, through TileLang, with no compile."""
    from qla_compile.kernels import _prebuilt

    shutil.copytree(_prebuilt.DIR, tmp_path / "prebuilt")
    manifest = json.loads((tmp_path / "prebuilt" / "manifest.json").read_text())
    (tmp_path / "prebuilt" / "manifest.json").write_text(json.dumps(dict(manifest, sources_sha256="0" * 64)))
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QLA_PREBUILT", raising=False)
    caplog.set_level(logging.WARNING, logger="qla_compile")
    kernel = launcher("seq_tables", "seq_tables", **PARAMS)
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 1 and "seq_tables(cu_dtype='int32') is not loaded straight from its prebuilt binary" in \
        logs[0] and "the kernel sources are not those the prebuilt binaries were built from" in logs[0], logs
    assert kernel.adapter.libpath.startswith(str(tmp_path / "cache" / "prebuilt"))


def test_build_artifact_reuses_the_installed_binary_of_a_matching_key(tables, tmp_path, monkeypatch, capsys):
    """``--build-artifact`` packs a variant whose key the installed binaries hold from them (a stand-in binary
    here, so that a compile would show), and writes the sources hash."""
    import tilelang

    from qla_compile import prebuild
    from qla_compile.kernels import TARGET, _prebuilt

    key = tables.seq_tables.key(**PARAMS)
    fake = tmp_path / "fake"
    fake.mkdir()
    for name in _prebuilt.FILES:
        (fake / name).write_bytes(f"stand-in {name}".encode())
    monkeypatch.setattr(_prebuilt, "DIR", str(tmp_path / "prebuilt"))
    _prebuilt.write([dict(module=MODULE, kernel="seq_tables", params=PARAMS, key=key, entry=str(fake))],
                    tilelang.__version__, TARGET, "0" * 64, {})
    monkeypatch.setattr(prebuild, "all_variants", lambda: [(MODULE, "seq_tables", PARAMS)])
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QLA_PREBUILT", "1")  # restored after build() sets it to 0
    prebuild.build(1, artifact=True)
    assert "seq_tables(cu_dtype='int32'): the installed prebuilt binary" in capsys.readouterr().out
    manifest = _prebuilt.manifest()
    assert manifest["sources_sha256"] == _prebuilt.sources_sha256()
    assert [v["key"] for v in manifest["variants"]] == [key]
    with tarfile.open(tmp_path / "prebuilt" / "kernels.tar.xz") as tar:
        assert tar.extractfile(f"{key}/executable.so").read() == b"stand-in executable.so"
    assert not (tmp_path / "cache" / "kernels").exists()
