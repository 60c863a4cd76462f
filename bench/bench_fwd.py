"""Forward benchmark on the GPU machine: qla vs FLA Triton vs FlashQLA vs FlashInfer 0.6 and 0.7, in one run.

Every implementation gets the same packed varlen inputs (B = 1 + cu_seqlens, see ``common.make_inputs``),
with the initial state and the final state output, and is timed as the median of CUDA-graph replays.
Per configuration we check our o and final state against FLA, every peer's o and final state against ours,
and our o on the first 1024 tokens against the float64 oracle. FlashQLA JIT-compiles per shape class
(20-60 s each), so it runs only while ``--flashqla-budget`` seconds of its compile+run time remain
(done-when configurations first), unless its kernels come built: ``bench/flashqla_cache.py`` builds every one
that the matrix and ``bench_bwd`` need on a CPU machine, into a ``TILELANG_CACHE_DIR`` to carry. The whole matrix
takes longer than one 10-minute device command: run it per head configuration,

    python bench/bench_fwd.py --heads 16/64 --out $OUT

``--heads`` and ``--seqs`` take explicit items (``16/64``, ``8192x4``, ``28672+4096``) and the named sets
``default``, ``wide`` and ``all``: ``wide`` is the high-parallelism serving matrix (H_v = H_qk heads 16/16 and
32/32; many short sequences 512x64 and 4096x8), kept out of the default so that one default command per
head configuration stays inside 10 minutes. ``--peers`` limits the peers (qla always runs).

FlashInfer 0.7 ("flashinfer-0.7": its CuTe-DSL SM90 GDN prefill, with its own intra-card CP under
``use_cp="auto"``) cannot share an interpreter with FlashInfer 0.6.13 ("flashinfer", in the site bundle), so
it runs in a child process (``--fi07-worker``, protocol in ``bench/peer_process.py``) whose ``sys.path``
starts with the unpacked bundle of ``bench/flashinfer07_bundle.sh`` (``--fi07-path``, default ``$QLA_FI07_PATH``
or ``/tmp/fi07``; used whenever it exists). The child builds the same seeded inputs, times FlashInfer 0.7
and qla in its own process (the table's FlashInfer 0.7/qla ratio uses that qla time), and hands FlashInfer's
o and final state back through a file, so this process checks them against its own qla output and the
float64 oracle like any other peer.
"""

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's own Triton path, not its FlashQLA dispatch
os.environ["FLA_QLA_COMPILE"] = "0"  # FLA's own kernels: not our backend in its registry (the peer would be us)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import make_inputs, parse_seqs, rel_l2, time_graph, versions  # noqa: E402

HEADS = [(2, 8), (4, 16), (8, 32), (16, 32), (16, 64)]
SEQS = ["1x32768", "1x8192", "1x2048", "28672+4096", "8192x4", "1024x8"]
# high-parallelism serving shapes: H_v = H_qk, many short sequences (selectable, not in the default run)
HEADS_WIDE = [(16, 16), (32, 32)]
SEQS_WIDE = ["512x64", "4096x8"]
HEAD_SETS = {"default": HEADS, "wide": HEADS_WIDE, "all": HEADS + HEADS_WIDE}
SEQ_SETS = {"default": SEQS, "wide": SEQS_WIDE, "all": SEQS + SEQS_WIDE}
PEERS = ["fla", "flashqla", "flashinfer", "flashinfer-0.7"]  # table order; qla always runs
FI07 = "flashinfer-0.7"
ORACLE_TOKENS = 1024


def peers(selected):
    """name -> fn(x) returning (o [1,T,Hv,V], final state [N,Hv,K,V]) for qla and each selected peer that
    imports in this process (FlashInfer 0.7 runs in its own process: ``Fi07Peer``)."""
    fns = {}
    from qla_compile.kernels import chunk_gdr_fwd_hopper

    fns["qla"] = lambda x: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])
    if "fla" in selected:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

            fns["fla"] = lambda x: fla(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"],
                                       initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu"])
        except ImportError as err:
            print("FLA unavailable:", err)
    if "flashqla" in selected:
        try:
            import flash_qla

            fns["flashqla"] = lambda x: flash_qla.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
                output_final_state=True, cu_seqlens=x["cu"])
        except ImportError as err:
            print("FlashQLA unavailable:", err)
    if "flashinfer" in selected:
        try:
            from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi

            def flashinfer(x, transposed=False):
                """FlashInfer wants alpha = exp(g), fp32 beta and a preallocated state output; its state
                orientation is not documented, so ``transposed`` passes h0 as [N, H, V, K] and reads the
                final state back the same way (main() keeps whichever matches our output)."""
                n, hv, dk, dv = x["h0"].shape
                if "fi_state" not in x:
                    x["fi_state"] = torch.empty(n, hv, dk, dv, device="cuda", dtype=torch.float32)
                    x["fi_alpha"] = x["g"][0].exp()
                    x["fi_beta"] = x["beta"][0].float()
                    x["fi_h0t"] = x["h0"].mT.contiguous()
                o = fi(x["q"][0], x["k"][0], x["v"][0], g=x["fi_alpha"], beta=x["fi_beta"], scale=x["scale"],
                       initial_state=x["fi_h0t"] if transposed else x["h0"], output_final_state=True,
                       cu_seqlens=x["cu"], output_state=x["fi_state"])
                o = o[0] if isinstance(o, tuple) else o
                return o[None], (x["fi_state"].mT if transposed else x["fi_state"])

            fns["flashinfer"] = flashinfer
        except ImportError as err:
            print("FlashInfer unavailable:", err)
    return fns


def fi07_call(fi, use_cp):
    """fn(x) -> (o [1,T,Hv,V], final state [N,Hv,K,V]) through FlashInfer 0.7's ``chunk_gated_delta_rule``.

    Its conventions (flashinfer/gdn_prefill.py of 0.7.2.post1): packed ``[T, H, 128]`` q/k/v; ``g`` is the
    decay alpha in linear space (exp of our log-space gate) and ``beta`` fp32, both ``[T, H_v]``; the states
    are ``[N, H_v, V, K]`` (ours transposed); ``cu_seqlens`` int32 or int64; ``max_seqlen`` a host bound
    that lets its CP kernels launch smaller grids (we pass the exact one, as a caller with host lengths
    would). Like the 0.6.13 peer, the gate/state conversions are made once per input, outside the timing.
    """

    def call(x):
        if "fi07" not in x:
            n, hv, dk, dv = x["h0"].shape
            x["fi07"] = {"alpha": x["g"][0].exp().contiguous(), "beta": x["beta"][0].float().contiguous(),
                         "h0": x["h0"].mT.contiguous(), "o": torch.empty_like(x["v"][0]),
                         "ht": torch.empty(n, hv, dv, dk, device=x["h0"].device, dtype=torch.float32),
                         "max_seqlen": int((x["cu"][1:] - x["cu"][:-1]).max())}
        p = x["fi07"]
        fi(x["q"][0], x["k"][0], x["v"][0], g=p["alpha"], beta=p["beta"], scale=x["scale"], initial_state=p["h0"],
           output_final_state=True, cu_seqlens=x["cu"], output=p["o"], output_state=p["ht"], use_cp=use_cp,
           max_seqlen=p["max_seqlen"])
        return p["o"][None], p["ht"].mT

    return call


def orient_flashinfer(fn, x, out, o):
    """``(output, call)``: FlashInfer's ``out`` for ``x`` (from ``fn(x)``) or its run with the state transposed,
    whichever agrees better with our output ``o`` (its state orientation is not documented), and the call that
    gives it."""
    flipped = fn(x, transposed=True)
    if rel_l2(flipped[0], o) < rel_l2(out[0], o):
        return flipped, functools.partial(fn, transposed=True)
    return out, fn


def input_fingerprint(x):
    """float64 sums of the inputs: the child's seeded inputs must be this process's, bit for bit."""
    return [float(x[name].double().sum()) for name in ("q", "k", "v", "g", "beta", "h0", "cu")]


def import_fi07(path):
    """(FlashInfer 0.7's ``chunk_gated_delta_rule``, its versions) from the unpacked bundle at ``path``, put first on
    ``sys.path`` (this interpreter then has no FlashInfer 0.6.13)."""
    info_path = os.path.join(path, "fi07_bundle.json")
    info = {}
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
    dsl = os.path.join(path, info.get("dsl_path", "nvidia_cutlass_dsl/dsl_packages"))
    sys.path[:0] = [path] + ([dsl] if os.path.isdir(dsl) else [])
    import flashinfer
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    where = os.path.realpath(flashinfer.__file__)
    if not where.startswith(os.path.realpath(path) + os.sep):
        raise ImportError(f"flashinfer imported from {where}, not from {path}")
    vers = {"flashinfer": flashinfer.__version__}
    try:
        from importlib.metadata import version

        vers["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl-libs-base")
    except Exception:  # noqa: BLE001 - the version is informative only
        vers["nvidia-cutlass-dsl"] = info.get("nvidia-cutlass-dsl", "unknown")
    return chunk_gated_delta_rule, vers


def fi07_worker(path, cp_mode):
    """The child process of ``Fi07Peer``: FlashInfer 0.7 from ``path`` first on sys.path, qla beside it."""
    from bench.peer_process import serve

    state = {}

    def setup():
        t = time.time()
        use_cp = {"auto": "auto", "on": True, "off": False}[cp_mode]
        fi, vers = import_fi07(path)
        state["fi"] = fi07_call(fi, use_cp)
        state["cp_rule"] = cp_rule(use_cp)
        try:
            from qla_compile.kernels import chunk_gdr_fwd_hopper

            state["qla"] = lambda x: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"],
                                                          x["h0"], x["cu"])
        except ImportError as err:  # the table then falls back to the main process's qla time
            print(f"qla unavailable beside FlashInfer 0.7: {err}", file=sys.stderr)
        return {"versions": vers, "qla": "qla" in state, "use_cp": cp_mode, "import_s": round(time.time() - t, 2)}

    def handle(req):
        x = make_inputs(req["hk"], req["hv"], parse_seqs(req["seqs"]))
        reply = {"fingerprint": input_fingerprint(x), "ms": {}, "cp": state["cp_rule"](x)}
        # timed in turns, qla, FlashInfer 0.7, qla, FlashInfer 0.7, each the lower of its two medians: the clocks a
        # heavy row leaves the GPU at (power capping) then weigh on both alike
        for name in ("qla", FI07) * 2:
            fn = state["fi"] if name == FI07 else state.get(name)
            if fn is None or name in reply.get("errors", {}):
                continue
            t = time.time()
            try:
                if name not in reply["ms"]:  # its first turn
                    o, ht = fn(x)
                    torch.cuda.synchronize()
                    if name == FI07:  # the first call compiles FlashInfer's kernels for a new variant
                        reply["first_call_s"] = round(time.time() - t, 2)
                        torch.save({"o": o.cpu(), "ht": ht.cpu()}, req["out_path"])
                ms = round(time_graph(lambda: fn(x), reps=10), 4)
                reply["ms"][name] = min(ms, reply["ms"].get(name, ms))
            except Exception as err:  # noqa: BLE001 - reported; the parent goes on
                reply.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
        return reply

    return serve(setup, handle)


def cp_rule(use_cp):
    """fn(x) -> whether FlashInfer 0.7's dispatch takes its CP path for x (its own host heuristic), or None
    where this version has no such helper."""
    try:
        from flashinfer.gdn_kernels.delta_rule_dsl.varlen_helper import should_use_cp_host
    except ImportError:
        return lambda x: None
    if isinstance(use_cp, bool):
        return lambda x: use_cp
    prop = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability(0)

    def rule(x):
        work = (len(x["cu"]) - 1) * max(x["q"].shape[2], x["v"].shape[2])
        return cap[0] in (9, 10, 12) and bool(should_use_cp_host(work, prop.multi_processor_count, prop.name,
                                                                  device_capability=cap))
    return rule


class Fi07Peer:
    """Parent side of the FlashInfer 0.7 child process: one request per configuration."""

    def __init__(self, path, cp_mode):
        from bench.peer_process import PeerProcess

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--fi07-worker", "--fi07-path", path,
               "--fi07-cp", cp_mode]
        self.proc = PeerProcess(cmd, FI07, cwd=root)
        # o can be 0.5 GB (16/64 1x32768): /dev/shm only where it has room, else the temp folder
        shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 << 30
        self.tmp = tempfile.mkdtemp(prefix="fi07-", dir="/dev/shm" if shm else None)
        self.out_path = os.path.join(self.tmp, "out.pt")

    def ready(self):
        """The child's hello, or None (with the reason printed) when it could not start."""
        from bench.peer_process import PeerError

        try:
            hello = self.proc.wait_ready(timeout=600)
        except PeerError as err:
            print(f"{FI07} unavailable: {err}")
            return None
        print(f"{FI07} process ready: {hello['versions']}, import {hello['import_s']} s, use_cp={hello['use_cp']}, "
              f"qla beside it: {hello['qla']}")
        return hello

    def run(self, x, hk, hv, spec):
        """(ms, (o, ht) on the GPU or None, check fields) for one configuration; ms None where it failed."""
        from bench.peer_process import PeerError

        try:
            rep = self.proc.request({"hk": hk, "hv": hv, "seqs": spec, "out_path": self.out_path}, timeout=600)
        except PeerError as err:
            print(f"{FI07} failed on {hk}/{hv} {spec}: {err}")
            return None, None, {}
        if "error" in rep:
            print(f"{FI07} failed on {hk}/{hv} {spec}: {rep['error']}\n{rep.get('traceback', '')}")
            return None, None, {}
        for name, err in rep.get("errors", {}).items():
            print(f"{FI07} process: {name} failed on {hk}/{hv} {spec}: {err}")
        mine = input_fingerprint(x)
        same = all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9) for a, b in zip(rep["fingerprint"], mine))
        check = {f"{FI07}_inputs_match": same, f"{FI07}_cp": rep.get("cp")}
        if "qla" in rep["ms"]:
            check[f"{FI07}_qla_ms"] = rep["ms"]["qla"]
        if "first_call_s" in rep:
            check[f"{FI07}_first_call_s"] = rep["first_call_s"]
        out = None
        if FI07 in rep["ms"]:
            saved = torch.load(self.out_path)
            out = (saved["o"].cuda(), saved["ht"].cuda())
            os.remove(self.out_path)
        return rep["ms"].get(FI07), out, check

    def close(self):
        self.proc.close()
        if os.path.exists(self.out_path):
            os.remove(self.out_path)
        os.rmdir(self.tmp)


def first_call_seconds():
    """Seconds from a fresh interpreter to the first qla result (import torch and qla, load, run)."""
    code = ("import time; t = time.time(); import torch; from bench.common import make_inputs; "
            "from qla_compile.kernels import chunk_gdr_fwd_hopper as f; x = make_inputs(2, 8, [100]); "
            "f(x['q'], x['k'], x['v'], x['g'], x['beta'], x['scale'], x['h0'], x['cu']); "
            "torch.cuda.synchronize(); print(time.time() - t)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def oracle_prefix(x, o):
    """Relative L2 error of o on the first tokens of sequence 0 against the float64 oracle."""
    from qla_compile.reference import recurrent_gdr_reference

    n = min(ORACLE_TOKENS, int(x["cu"][1]))
    ref, _ = recurrent_gdr_reference(x["q"][:, :n], x["k"][:, :n], x["v"][:, :n], x["g"][:, :n], x["beta"][:, :n],
                                     x["scale"], x["h0"][:1])
    return rel_l2(o[:, :n], ref)


def expand(spec, sets, parse):
    """Comma-separated items and named sets (``default``, ``wide``, ``all``) -> list, in order, no repeats."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        for value in sets[item] if item in sets else [parse(item)]:
            if value not in out:
                out.append(value)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="results folder (merged with what is there)")
    ap.add_argument("--flashqla-budget", type=float, default=150.0, help="seconds of FlashQLA compile+run")
    ap.add_argument("--heads", default="default",
                    help="H_qk/H_v items and sets: default = " + ",".join(f"{a}/{b}" for a, b in HEADS)
                    + "; wide = " + ",".join(f"{a}/{b}" for a, b in HEADS_WIDE) + "; all = both")
    ap.add_argument("--seqs", default="default",
                    help="sequence mixes and sets: default = " + ",".join(SEQS) + "; wide = " + ",".join(SEQS_WIDE)
                    + "; all = both")
    ap.add_argument("--peers", default="all",
                    help="peers to run beside qla: all, or a comma list of " + ",".join(PEERS)
                    + f" (missing ones are skipped; an explicit {FI07} without its bundle is an error)")
    ap.add_argument("--fi07-path", default=os.environ.get("QLA_FI07_PATH", "/tmp/fi07"),
                    help=f"unpacked bench/flashinfer07_bundle.sh parts; {FI07} runs when it exists")
    ap.add_argument("--fi07-cp", choices=("auto", "on", "off"), default="auto",
                    help="FlashInfer 0.7's use_cp (auto: its own heuristic, what its users get)")
    ap.add_argument("--fi07-worker", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    args.heads = expand(args.heads, HEAD_SETS, lambda h: tuple(int(s) for s in h.split("/")))
    args.seqs = expand(args.seqs, SEQ_SETS, lambda s: (parse_seqs(s), s)[1])
    args.explicit_peers = args.peers != "all"
    args.peers = PEERS if args.peers == "all" else expand(args.peers, {}, str)
    unknown = sorted(set(args.peers) - set(PEERS) - {"qla"})
    if unknown:
        ap.error(f"unknown peers {unknown}; known: {PEERS}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.fi07_worker:
        return fi07_worker(args.fi07_path, args.fi07_cp)
    heads, seqs = args.heads, args.seqs
    fi07 = None
    if FI07 in args.peers:
        if os.path.isdir(args.fi07_path):
            fi07 = args.fi07_path
        elif args.explicit_peers:
            raise SystemExit(f"{FI07} asked for, but {args.fi07_path} does not exist (bench/flashinfer07_bundle.sh)")
        else:
            print(f"{FI07} skipped: no bundle at {args.fi07_path}")

    # two fresh processes: the first on a new machine can also pay cold file caches and bytecode writes
    cold, first_call = first_call_seconds(), first_call_seconds()
    print(f"qla in a fresh process: import + first call {first_call:.2f} s (first process on the machine {cold:.2f} s)")
    fi07 = Fi07Peer(fi07, args.fi07_cp) if fi07 else None  # imports while this process imports its peers
    fns = peers(args.peers)
    meta = {"versions": versions(), "first_call_s": round(first_call, 2), "first_call_cold_s": round(cold, 2)}
    if fi07 is not None:
        hello = fi07.ready()
        if hello is None:
            fi07.close()
            fi07 = None
        else:
            meta["versions"][FI07] = " ".join(f"{k} {v}" for k, v in hello["versions"].items())
            meta["fi07_use_cp"] = hello["use_cp"]
            meta["fi07_import_s"] = hello["import_s"]

    configs = [(hk, hv, s) for hk, hv in heads for s in seqs]
    # FlashQLA's JIT budget goes to the done-when configurations (H_v x sequences >= 64) first.
    fq_order = sorted(configs, key=lambda c: c[1] * len(parse_seqs(c[2])) < 64)
    fq_left = args.flashqla_budget
    rows, checks = [], []
    meta["checks"] = checks
    md = "no configurations"
    try:
        for hk, hv, spec in sorted(configs, key=fq_order.index):
            x = make_inputs(hk, hv, parse_seqs(spec))
            outs = {}
            for name, fn in fns.items():
                if name == "flashqla" and fq_left <= 0:
                    continue
                t = time.time()
                try:
                    outs[name] = fn(x)
                    ms = time_graph(lambda: fn(x), reps=10)
                except Exception as err:  # noqa: BLE001 - a failing peer is reported, not fatal
                    print(f"{name} failed on {hk}/{hv} {spec}: {type(err).__name__}: {err}")
                    continue
                finally:
                    if name == "flashqla":
                        fq_left -= time.time() - t
                rows.append({"op": "fwd", "hk": hk, "hv": hv, "seqs": spec, "impl": name, "ms": round(ms, 4)})
            fi07_check = {}
            if fi07 is not None:
                ms, out, fi07_check = fi07.run(x, hk, hv, spec)
                if ms is not None:
                    rows.append({"op": "fwd", "hk": hk, "hv": hv, "seqs": spec, "impl": FI07, "ms": ms})
                if out is not None:
                    outs[FI07] = out
            o, ht = outs["qla"]
            if "flashinfer" in outs:
                outs["flashinfer"], _ = orient_flashinfer(fns["flashinfer"], x, outs["flashinfer"], o)
            check = {"hk": hk, "hv": hv, "seqs": spec, "qla_vs_fp64_o_prefix": oracle_prefix(x, o)}
            for name in PEERS:
                if name in outs:
                    check[f"{name}_o_vs_qla"] = rel_l2(outs[name][0], o)
                    check[f"{name}_ht_vs_qla"] = rel_l2(outs[name][1], ht)
            if FI07 in outs:
                check[f"{FI07}_vs_fp64_o_prefix"] = oracle_prefix(x, outs[FI07][0])
            check.update(fi07_check)
            checks.append(check)
            line = " ".join(f"{r['impl']} {r['ms']:.3f}" for r in rows if (r["hk"], r["hv"], r["seqs"]) == (hk, hv, spec))
            errs = " ".join(f"{k.replace('_vs_', '/')} {v:.1e}" for k, v in check.items()
                            if isinstance(v, float) and k.endswith(("_vs_qla", "prefix")))
            print(f"{hk}/{hv} {spec}: {line} | {errs}" + (f" | {FI07} cp {fi07_check.get(f'{FI07}_cp')}" if fi07_check else ""))
            del x, outs
            torch.cuda.empty_cache()
            md = save(args.out, rows, meta)  # after every configuration, so a cut-short run keeps its rows
    finally:
        if fi07 is not None:
            fi07.close()
    print(md)
    return 0


def save(out, rows, meta):
    """Write the results, merged with rows and checks of other configurations already in ``out``
    (so the matrix can be run one head configuration per command)."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("latest-fwd.json", "latest-fwd-meta.json")]
    done = {(r["hk"], r["hv"], r["seqs"]) for r in rows}
    old_rows, old_checks = [], []
    if all(os.path.exists(p) for p in paths):
        with open(paths[0]) as f:
            old_rows = [r for r in json.load(f) if (r["hk"], r["hv"], r["seqs"]) not in done]
        with open(paths[1]) as f:
            old_checks = [c for c in json.load(f)["checks"] if (c["hk"], c["hv"], c["seqs"]) not in done]
    rows = old_rows + rows
    meta = {**meta, "checks": old_checks + meta["checks"]}
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        json.dump(meta, f, indent=1)
    md = render(rows, meta)
    with open(os.path.join(out, f"{datetime.date.today().isoformat()}-fwd.md"), "w") as f:
        f.write(md)
    return md


LABELS = {"qla": "qla", "fla": "FLA", "flashqla": "FlashQLA", "flashinfer": "FlashInfer", FI07: "FlashInfer 0.7"}


def render(rows, meta):
    """Markdown table: ms per implementation and each peer's time over ours, plus the checks.
    FlashInfer 0.7 runs in its own process; its ratio is taken over the qla time measured in that process."""
    by = {}
    for r in rows:
        by.setdefault((r["hk"], r["hv"], r["seqs"]), {})[r["impl"]] = r["ms"]
    checks = {(c["hk"], c["hv"], c["seqs"]): c for c in meta["checks"]}
    present = {impl for t in by.values() for impl in t}
    peer_cols = [p for p in PEERS if p in present]
    lines = [
        "# Forward benchmark (CUDA-graph medians, ms)", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
        f"qla in a fresh process with a warm kernel cache: import + first call {meta['first_call_s']} s "
        f"({meta.get('first_call_cold_s', '-')} s in the first process on the machine)", "",
        *[line for note in meta.get("notes", []) for line in (note, "")],
        "| H_qk/H_v | seqs | " + " | ".join(LABELS[c] for c in ["qla"] + peer_cols) + " | "
        + " | ".join(f"{LABELS[c]}/qla" for c in peer_cols) + " |",
        "|---|---|" + "---|" * (1 + 2 * len(peer_cols)),
    ]
    ratios = {c: {} for c in peer_cols}
    for key, t in by.items():
        q = t.get("qla")

        def cell(name):
            return f"{t[name]:.3f}" if name in t else "-"

        def ratio(name):
            base = checks.get(key, {}).get(f"{FI07}_qla_ms", q) if name == FI07 else q
            if name not in t or not base:
                return "-"
            ratios[name][key] = t[name] / base
            return f"{ratios[name][key]:.2f}"

        hk, hv, spec = key
        cells = [cell(c) for c in ["qla"] + peer_cols] + [ratio(c) for c in peer_cols]
        lines.append(f"| {hk}/{hv} | {spec} | " + " | ".join(cells) + " |")
    if ratios.get("fla"):
        geo = math.exp(sum(math.log(r) for r in ratios["fla"].values()) / len(ratios["fla"]))
        lines += ["", f"Geometric-mean speedup over FLA: {geo:.2f}x over {len(ratios['fla'])} configurations"]
    filled = [r for (hk, hv, spec), r in ratios.get("flashqla", {}).items() if hv * len(parse_seqs(spec)) >= 64]
    if filled:
        lines += ["", f"FlashQLA/qla where H_v x sequences >= 64: min {min(filled):.2f}x over {len(filled)} configurations"]
    if ratios.get(FI07):
        r = ratios[FI07]
        geo = math.exp(sum(math.log(v) for v in r.values()) / len(r))
        lines += ["", f"FlashInfer 0.7/qla (qla timed in FlashInfer 0.7's process): min {min(r.values()):.2f}x, "
                  f"geometric mean {geo:.2f}x over {len(r)} configurations"]
    bar = [c for c in ("flashqla", "flashinfer", FI07) if ratios.get(c)]
    if bar:  # issue 20's bar: the fastest of these peers over qla, each as in its column
        best = [min(ratios[c][key] for c in bar if key in ratios[c])
                for key in by if any(key in ratios[c] for c in bar)]
        geo = math.exp(sum(math.log(v) for v in best) / len(best))
        lines += ["", f"Fastest of {', '.join(LABELS[c] for c in bar)} / qla: min {min(best):.2f}x, geometric mean "
                  f"{geo:.3f}x over {len(best)} configurations, {sum(v < 1.0 for v in best)} below 1.0"]
    behind = [f"{hk}/{hv} {spec} ({LABELS[c]} {ratios[c][(hk, hv, spec)]:.2f}x)"
              for (hk, hv, spec) in by for c in peer_cols if ratios[c].get((hk, hv, spec), 2.0) < 1.0]
    if behind:
        lines += ["", "Where a peer is faster than qla: " + ", ".join(behind)]
    lines += ["", "## Checks (relative L2)", "", "```", json.dumps(meta["checks"], indent=1), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
