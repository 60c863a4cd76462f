"""First use on the GPU: what a fresh process with an empty ~/.cache and nothing but the package waits for.

    PYTHONPATH=. python bench/first_use.py --out bench/results/latest-first-use.json

Each measurement is a new Python process whose HOME and XDG_CACHE_HOME are an empty temporary directory (and
without QLA_*/TILELANG_* settings, so no kernel cache is found). It times ``import qla_compile`` after
``import torch``, making the inputs on the GPU (CUDA's start-up), and the first call of
``qla_compile.chunk_gated_delta_rule`` (synchronised), then a second call: a forward alone (no grad), or in its own
process a forward and backward. bf16, K = V = 128, one Qwen3-Next-sized layer (16 qk-heads, 32 v-heads, T = 4096,
q/k L2 norm in the op; its backward runs context-parallel). Both with the package's prebuilt kernels and with
``QLA_PREBUILT=0`` (every kernel JIT-compiled: the cold cost), each cold process stopped after --cold-timeout
seconds. Prints a table and writes JSON to --out.

Python's bytecode (``--bytecode``, each row says which it had): the device runs Python with
PYTHONDONTWRITEBYTECODE=1 and a torch install without .pyc files, so there every process compiles the bytecode of
all it imports (seconds for torch alone), where a pip install would have left it compiled. Both are measured, each
child with PYTHONDONTWRITEBYTECODE=1 and its own PYTHONPYCACHEPREFIX (a directory Python reads .pyc files from
instead of ``__pycache__``): ``cached``, a directory that a warm-up child filled first by running the prebuilt
forward and backward and importing TileLang with bytecode writing on (so it holds what the children import,
whatever the install ships); ``none``, an empty one (nothing precompiled, as on the device). The JIT rows run once,
with the first of the modes: their compiles dwarf the bytecode.

From a checkout (PYTHONPATH at the repository root, no pip install) the prebuilt kernels are the tracked files in
``qla_compile/kernels/prebuilt/``, found exactly as in an installed package.
"""
import argparse
import json
import logging
import os
import signal
import site
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, T, H, HV, D = 1, 4096, 16, 32, 128
CASES = ("fwd", "fwd+bwd")
BYTECODE = {"cached": "precompiled by a warm-up child (as a pip install leaves it)",
            "none": "none: every module compiled in the child (as on the device)"}
TAG = "FIRST_USE "  # the child's result lines


def _emit(**values):
    print(TAG + json.dumps(values), flush=True)


class _Compiles(logging.Handler):
    """The kernels qla_compile JIT-compiles (it logs one line for each)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def emit(self, record):
        if "compiling the kernel" in record.getMessage():
            self.seen.append(record.getMessage())


def child(case, profile=None):
    """One measurement, in this fresh process: result lines on stdout as each step ends; with ``profile`` (a
    path), a cProfile of the first call written there as text (the 40 costliest functions, cumulative)."""
    start = time.perf_counter()
    import torch

    after_torch = time.perf_counter()
    import qla_compile
    from qla_compile import dispatch

    _emit(import_torch_s=after_torch - start, import_qla_compile_s=time.perf_counter() - after_torch)
    compiles = _Compiles()
    logging.getLogger("qla_compile").addHandler(compiles)

    t = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, HV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen))
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(torch.bfloat16)
    inputs = [q, k, v, g, beta]
    for x in inputs:
        x.requires_grad_(case == "fwd+bwd")
    torch.cuda.synchronize()
    _emit(inputs_s=time.perf_counter() - t, gpu=torch.cuda.get_device_name(), torch=torch.__version__)

    def call():
        t = time.perf_counter()
        o, _ = qla_compile.chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)
        if case == "fwd+bwd":
            torch.autograd.grad(o, inputs, torch.ones_like(o))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        first = prof.runcall(call)
        with open(profile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
    else:
        first = call()
    _emit(first_call_s=first, compiles=len(compiles.seen))
    _emit(second_call_s=call(), impl=sorted({impl for impl, _ in dispatch.choices()}), compiled=compiles.seen)


def _fresh_env(home, prebuilt, pycache, write_bytecode=False):
    """A child's environment: an empty ``home``, no QLA_*/TILELANG_* settings, bytecode read from (and with
    ``write_bytecode`` written to) the directory ``pycache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QLA_", "TILELANG_", "PYTHONDONTWRITEBYTECODE"))}
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"), PYTHONPATH=os.pathsep.join(path),
               PYTHONUSERBASE=site.getuserbase(),  # an empty HOME, but packages installed for the user stay visible
               PYTHONPYCACHEPREFIX=pycache)
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if not prebuilt:
        env["QLA_PREBUILT"] = "0"
    return env


def warm_up(pycache):
    """Fill the bytecode directory ``pycache``: a child that runs the prebuilt forward and backward, then imports
    TileLang, with bytecode writing on."""
    with tempfile.TemporaryDirectory(prefix="qla-first-use-") as home:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--warm-up"], capture_output=True,
                              text=True, env=_fresh_env(home, True, pycache, write_bytecode=True), timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the bytecode warm-up failed:\n{proc.stderr[-2000:]}")


def measure(case, prebuilt, timeout, bytecode, pycache, profile_dir=None):
    """One fresh child process (Python's bytecode from the directory ``pycache``, ``bytecode`` naming it): what it
    reported, with its wall time and whether it was stopped."""
    binaries = "prebuilt" if prebuilt else "jit"
    profile = ["--profile-to", os.path.join(profile_dir, f"{binaries}-{bytecode}-{case}.txt")] if profile_dir else []
    with tempfile.TemporaryDirectory(prefix="qla-first-use-") as home:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", case] + profile,
                                env=_fresh_env(home, prebuilt, pycache), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            stopped = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # with its compilers
            out, err = proc.communicate()
            stopped = True
        run = dict(binaries=binaries, bytecode=bytecode, case=case, wall_s=time.perf_counter() - start,
                   returncode=proc.returncode, timed_out=stopped, timeout_s=timeout)
    for line in out.splitlines():
        if line.startswith(TAG):
            run.update(json.loads(line[len(TAG):]))
    if "first_call_s" in run:
        run["first_call_after_import_torch_s"] = run["import_qla_compile_s"] + run["inputs_s"] + run["first_call_s"]
    if proc.returncode != 0 and not stopped:
        run["stderr_tail"] = err[-2000:]
    return run


def _s(run, key):
    return f"{run[key]:.2f} s" if key in run else ("stopped" if run["timed_out"] else "failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--cold-timeout", type=float, default=240, help="seconds a JIT-compiling process may take")
    ap.add_argument("--skip-cold", action="store_true", help="only the prebuilt kernels")
    ap.add_argument("--bytecode", choices=("both", *BYTECODE), default="both",
                    help="Python's bytecode in the children: precompiled by a warm-up child, none, or both in turn")
    ap.add_argument("--profile", metavar="DIR", help="write a cProfile of each first call to DIR")
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--warm-up", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.profile_to)
    if args.warm_up:
        child("fwd+bwd")
        import tilelang  # noqa: F401  (what the JIT rows import besides)
        return None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    modes = ("cached", "none") if args.bytecode == "both" else (args.bytecode,)
    rows = [(True, case, mode) for mode in modes for case in CASES]
    rows += [] if args.skip_cold else [(False, case, modes[0]) for case in CASES]
    runs = []
    with tempfile.TemporaryDirectory(prefix="qla-first-use-pyc-") as pycache:
        dirs = {mode: os.path.join(pycache, mode) for mode in modes}
        if "cached" in dirs:
            warm_up(dirs["cached"])
        for prebuilt, case, mode in rows:
            timeout = 120 if prebuilt else args.cold_timeout
            runs.append(measure(case, prebuilt, timeout, mode, dirs[mode], args.profile))
            r = runs[-1]
            print(f"{r['binaries']:8} {mode:6} {case:8} import qla_compile {_s(r, 'import_qla_compile_s')}, inputs "
                  f"{_s(r, 'inputs_s')}, first call {_s(r, 'first_call_s')} ({r.get('compiles', '?')} compiles), "
                  f"after import torch {_s(r, 'first_call_after_import_torch_s')}, second call "
                  f"{_s(r, 'second_call_s')}, impl {r.get('impl')}", flush=True)
            if "stderr_tail" in r:
                print(r["stderr_tail"])
    print("\n| binaries | bytecode | case | import qla_compile | inputs (CUDA start) | first call | first call after "
          "import torch | compiles | second call |\n|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['binaries']} | {r['bytecode']} | {r['case']} | {_s(r, 'import_qla_compile_s')} | "
              f"{_s(r, 'inputs_s')} | {_s(r, 'first_call_s')} | {_s(r, 'first_call_after_import_torch_s')} | "
              f"{r.get('compiles', '?')} | {_s(r, 'second_call_s')} |")
    if args.out:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        with open(os.path.join(ROOT, "qla_compile", "kernels", "prebuilt", "manifest.json")) as f:
            manifest = json.load(f)
        meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit.stdout.strip() or None, shape=dict(
            B=B, T=T, H=H, HV=HV, K=D, V=D, dtype="bfloat16", use_qk_l2norm_in_kernel=True),
            tilelang_prebuilt=manifest["tilelang"], archive_sha256=manifest["archive_sha256"],
            bytecode={mode: BYTECODE[mode] for mode in modes})
        with open(args.out, "w") as f:
            json.dump(dict(meta, runs=runs), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
