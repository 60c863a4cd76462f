"""Real eager GDN code from packages that cannot share this process's imports, loaded as plain source.

* transformers <= 5.16 ("legacy": the 63-row substitution loop): its wheel sits in ``.sidepkgs/wheels``
  (CI: ``pip download --no-deps transformers==5.16.1 -d .sidepkgs/wheels``); we exec only
  ``torch_chunk_gated_delta_rule`` and its ``l2norm`` helper from the wheel's ``modeling_qwen3_next.py``.
* FLA (``.sidepkgs/fla``, CI: ``pip install --no-deps --target .sidepkgs/fla triton fla-core
  flash-linear-attention``): kept off ``sys.path``, because an importable FLA makes transformers' GDN
  layers dispatch to FLA's Triton kernels, which do not run on CPU.  ``naive.py`` needs only torch and
  einops, so it is loaded by path; the FLA layer tests run in a subprocess with FLA on ``PYTHONPATH``.

Missing side packages skip the tests locally and fail them in CI (``CI=true``).
"""
from __future__ import annotations

import ast
import importlib.util
import linecache
import os
import sys
import zipfile
from pathlib import Path

import pytest

SIDE = Path(__file__).resolve().parent.parent / ".sidepkgs"
FLA_DIR = SIDE / "fla"
LEGACY_WHEEL_GLOB = "transformers-5.1[0-6]*.whl"


def _missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing: .ci/run must provide it (see tests/legacy_sources.py)")
    pytest.skip(f"{what} is missing (see tests/legacy_sources.py for the pip command)")


def legacy_transformers_gdn():
    """``(torch_chunk_gated_delta_rule, version)`` from a real transformers <= 5.16 wheel."""
    wheels = sorted((SIDE / "wheels").glob(LEGACY_WHEEL_GLOB))
    if not wheels:
        _missing("a transformers <= 5.16 wheel in .sidepkgs/wheels")
    with zipfile.ZipFile(wheels[-1]) as whl:
        source = whl.read("transformers/models/qwen3_next/modeling_qwen3_next.py").decode()
    tree = ast.parse(source)
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("l2norm", "torch_chunk_gated_delta_rule")]
    for fn in wanted:
        fn.decorator_list = []  # the hub-kernel decorator belongs to transformers' runtime, not the algorithm
    import torch
    import torch.nn.functional as F

    filename = f"<{wheels[-1].name}:modeling_qwen3_next.py>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for dynamo's traces
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), filename, "exec"), namespace)
    return namespace["torch_chunk_gated_delta_rule"], wheels[-1].name.split("-")[1]


def fla_naive():
    """FLA's ``fla/ops/gated_delta_rule/naive.py`` as a module (torch + einops only)."""
    path = FLA_DIR / "fla" / "ops" / "gated_delta_rule" / "naive.py"
    if not path.exists():
        _missing("FLA in .sidepkgs/fla")
    spec = importlib.util.spec_from_file_location("fla_gdn_naive", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo resolves a function's globals through its module
    spec.loader.exec_module(module)
    return module


def fla_pythonpath() -> str:
    if not (FLA_DIR / "fla" / "layers").exists():
        _missing("FLA (with layers) in .sidepkgs/fla")
    return str(FLA_DIR)
