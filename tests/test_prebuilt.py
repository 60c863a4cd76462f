"""The prebuilt kernels on the CPU: variant keys follow the kernel sources and TileLang, the loader takes the
prebuilt binary, then the kernel cache, and compiles (logged, with why) only what neither holds, and
``prebuild --check`` reports what the installed binaries lack.

The loader test compiles the small varlen table kernel twice (a few seconds each; needs nvcc); the rest compile
nothing.
"""
import importlib.util
import json
import logging
import shutil

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")

PARAMS = dict(cu_dtype="int32")


@pytest.fixture
def tables():
    """``seq_tables`` with its memo cleared before and after (the tests change its source and the caches)."""
    from qla_compile.kernels import seq_tables

    seq_tables.seq_tables.cache_clear()
    yield seq_tables
    seq_tables.seq_tables.cache_clear()


def _write_manifest(directory, tilelang_version, variants):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(
        {"tilelang": tilelang_version, "target": {}, "archive_sha256": "", "variants": variants}))


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
                    [dict(module="qla_compile.kernels.seq_tables", kernel="seq_tables", params=PARAMS, key=key)])
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
    _prebuilt.write([dict(module="qla_compile.kernels.seq_tables", kernel="seq_tables", params=PARAMS, key=key,
                          entry=str(tmp_path / "build" / "kernels" / key))], tilelang.__version__, TARGET)

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
    (tmp_path / "prebuilt" / "manifest.json").write_text(json.dumps(manifest))
    assert prebuild.main(["--check"]) == 1
    out = capsys.readouterr().out
    n = len(prebuild.all_variants())
    assert f"2 of {n} kernel variants do not load from the prebuilt binaries" in out, out
    assert f"{dropped['kernel']}(" in out and "not among the prebuilt variants" in out
    assert "built from other kernel sources" in out

    (tmp_path / "prebuilt" / "kernels.tar.xz").write_bytes(b"not an archive")
    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path / "cache2"))
    assert prebuild.main(["--check"]) == 1
    assert "kernels.tar.xz is not the archive its manifest lists" in capsys.readouterr().out


def test_the_backward_s_kernels_as_called_are_shipped():
    """Variant keys hash the params as passed: the forward+backward's ``scan`` and ``chunk_grads`` calls spell out
    ``reverse`` and ``pdl`` as their listed variants do (on the H200 they compiled while they left them out)."""
    pytest.importorskip("tilelang")
    from qla_compile.kernels import _prebuilt, chunk_grads, context_parallel

    shipped = {v["key"] for v in _prebuilt.manifest()["variants"]}
    assert context_parallel.scan.key(dk=128, dv=128, has_h0=False, reverse=False) in shipped
    assert chunk_grads.chunk_grads.key(dk=128, dv=128, dtype="bfloat16", pdl=True) in shipped
    assert context_parallel.scan.key(dk=128, dv=128, has_h0=False) not in shipped  # why the calls spell them out
