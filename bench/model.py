"""Model-level benchmark on the GPU machine: a Qwen3-Next-shaped transformers model, as a user runs it.

Paths (each in the process it needs; the ``*-fla`` paths in one where qla_compile is never imported, so
nothing of ours is registered):

* ``eager-fla``: the model as written, transformers' GDN bound to FLA's Triton kernels (``FLA_FLASH_QLA=0``);
* ``inductor-fla``: ``torch.compile(model)`` with the same FLA kernels (a graph break at each FLA call). Before
  torch 2.13 dynamo answers ``torch.compiler.is_exporting()`` with True under ``torch.compile`` too
  (pytorch/pytorch#176347), and transformers' GDN wrapper then takes its PyTorch chunk loop, which Inductor
  unrolls (minutes of compile); so this path binds the model's GDN function to FLA's op directly, as transformers
  does eagerly and on torch >= 2.13;
* ``inductor-transformers`` (not in the default ``--paths``): plain ``torch.compile(model)``, whatever
  transformers' wrapper calls under dynamo on this torch;
* ``qla``: ``torch.compile(model, backend=qla_compile.backend)``;
* ``qla-reduce-overhead``: the same with ``mode="reduce-overhead"`` (CUDA graphs).

Models: ``dense`` (4 layers, 3 GDN with 16 qk / 32 v heads x 128 and 1 full attention, hidden 2048, MLP 4096,
vocab 4096, bf16, random weights) and ``moe`` (the same with 8 experts, top 2, expert MLP 1024, a shared
expert of 1024). Kinds: ``prefill`` (no grad) and ``train`` (``logits.float().logsumexp(-1).mean()
.backward()``). Per row: the median step time (CUDA events around ``--reps`` steps, median of
``--rounds``), the first call's seconds (compiles, autotuning; fresh Inductor and Triton caches per
process), graphs and graph breaks that dynamo counted while compiling at that length, and the relative L2 difference
of the logits and of one GDN layer's ``in_proj_qkvz`` gradient from ``eager-fla`` (on every 512th token's logits
and every 128th row of the gradient: ``eager-fla`` saves them in ``--refs``, small enough to carry to a later
run on another machine). One profiled step per
(model, kind, path) at the first length gives the GDN op's share of the device time and the top kernels.

    python bench/model.py --out $OUT [--models dense,moe] [--lengths 4096,16384,32768] [--kinds prefill,train]
                          [--paths eager-fla,inductor-fla,qla,qla-reduce-overhead] [--profile]
                          [--budget-s S]

A run may measure some paths, models or lengths only: its rows replace those it measured in ``--out``'s
``latest-model.json`` and keep the rest (copy the committed results there first to extend them). The
``*-fla`` paths of a row's ratios must come from runs on the same machine.
"""

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import rel_l2, versions  # noqa: E402

GROUPS = {"fla": ("eager-fla", "inductor-fla", "inductor-transformers"), "qla": ("qla", "qla-reduce-overhead")}
DEFAULT_PATHS = ("eager-fla", "inductor-fla", "qla", "qla-reduce-overhead")
GDN_OPS = ("qla::chunk_gdr_fwd", "qla::chunk_gdr_bwd", "ChunkGatedDeltaRuleFunction",
           "ChunkGatedDeltaRuleFunctionBackward")
REF_DIR = os.path.join(tempfile.gettempdir(), "qla-model-bench-ref")
TOKEN_STRIDE, ROW_STRIDE = 512, 128  # the subsample of logits and gradient that the error columns compare


def config(kind):
    """The Qwen3NextConfig arguments of the ``dense`` or ``moe`` model."""
    cfg = dict(
        vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=16, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=65536,
    )
    if kind == "dense":
        cfg.update(mlp_only_layers=[0, 1, 2, 3])
    else:
        cfg.update(mlp_only_layers=[], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                   shared_expert_intermediate_size=1024)
    return cfg


def build(kind):
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config(kind)))  # the same weights in every process
    return model.to(device="cuda", dtype=torch.bfloat16)


def gdn_implementation():
    """(the function transformers' Qwen3-Next GDN wrapper dispatches to here eagerly, the names it passes on)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    fn = m.torch_chunk_gated_delta_rule
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return cells.get("implementation", fn), cells.get("applicable_params")


@functools.cache
def gdn_binding():
    impl, _ = gdn_implementation()
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"


@contextlib.contextmanager
def gdn_bound_to_fla():
    """Within: the modeling module's GDN function is what its wrapper calls eagerly (FLA's op), with the
    wrapper's filtering of keyword arguments."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    impl, params = gdn_implementation()
    if not impl.__module__.startswith("fla."):
        raise RuntimeError(f"inductor-fla: transformers' GDN dispatches to {gdn_binding()}, not to FLA")

    def fla_gdn(*args, **kwargs):
        return impl(*args, **{k: v for k, v in kwargs.items() if k in params})
    wrapper, m.torch_chunk_gated_delta_rule = m.torch_chunk_gated_delta_rule, fla_gdn
    try:
        yield
    finally:
        m.torch_chunk_gated_delta_rule = wrapper


def compiled(model, path):
    import torch

    if path in ("inductor-fla", "inductor-transformers"):
        return torch.compile(model)
    import qla_compile

    qla_compile.register_substitutions()
    mode = "reduce-overhead" if path == "qla-reduce-overhead" else None
    return torch.compile(model, backend=qla_compile.backend, mode=mode)


def step_fn(model, fn, ids, kind, cuda_graphs):
    import torch

    def step():
        if cuda_graphs:  # a new iteration: the last one's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if kind == "prefill":
            with torch.no_grad():
                return fn(input_ids=ids, use_cache=False).logits
        model.zero_grad(set_to_none=True)
        logits = fn(input_ids=ids, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
        return logits.detach()
    return step


def events_ms(step, reps):
    """ms per step of ``reps`` steps back to back, between two CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def median_ms(step, reps, rounds):
    return statistics.median(events_ms(step, reps) for _ in range(rounds))


def dynamo_counts():
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def profile_step(step, by_launch=False):
    """(GPU-busy ms of the GDN ops' kernels, GPU-busy ms of all kernels, the top kernels [(name, ms)], the top
    kernels inside the GDN ops [(name, ms)]) of one step. Busy time is the union of the kernels' intervals: kernels
    that run at once (ours beside the state recompute on a second stream, ``chunk_grads`` as the reverse
    recurrence's programmatic dependent, waiting beside it) count once, where the sum of their durations would
    count the overlap twice. With ``by_launch`` the kernels inside the GDN ops are listed one per launch, in launch
    order, a name launched more than once numbered (``kernel_kernel#2``: our TileLang kernels all bear that name)
    and the list not cut."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    # a profiler range (ops.EagerChunkGDR's, a compiled graph's) also shows as a GPU-side annotation spanning its
    # kernels: not a kernel
    per_name = [e for e in prof.key_averages() if e.device_type == cuda and not e.is_user_annotation]
    per_name.sort(key=lambda e: -e.self_device_time_total)
    top = [(e.key[:90], round(e.self_device_time_total / 1e3, 3)) for e in per_name[:12]]
    kernels = [e for e in prof.events() if e.device_type == cuda and not e.is_user_annotation]
    # kernels launched through the driver API (Triton's, TileLang's) inside a profiler range (EagerChunkGDR's) are
    # not linked to it on the CPU side: for a GDN op with such a range, take the kernels inside its GPU annotation
    spans = [e for e in prof.events() if e.key in GDN_OPS and e.device_type == cuda]
    ranged = {e.key for e in spans}
    inside = {id(e): e for e in kernels if any(
        s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end for s in spans)}
    launched_by = _launches(prof.events(), kernels)
    for event in prof.events():  # the other GDN ops: the kernels below them (outermost ones only)
        if (event.key in GDN_OPS and event.key not in ranged and event.device_type != cuda
                and not _below_gdn(event.cpu_parent)):
            inside.update((id(k), k) for k in _kernels_below(event, launched_by))
    launches = sorted(inside.values(), key=lambda e: e.time_range.start)
    gdn_ms, total_ms = _busy_us(launches) / 1e3, _busy_us(kernels) / 1e3
    if by_launch:
        seen, repeated = collections.Counter(), collections.Counter(e.name[:90] for e in launches)
        gdn_top = []
        for e in launches:
            name = e.name[:90]
            seen[name] += 1
            gdn_top.append((f"{name}#{seen[name]}" if repeated[name] > 1 else name,
                            round(e.time_range.elapsed_us() / 1e3, 3)))
        return gdn_ms, total_ms, top, gdn_top
    by_name = collections.Counter()
    for e in launches:
        by_name[e.name[:90]] += e.time_range.elapsed_us()
    gdn_top = [(name, round(us / 1e3, 3)) for name, us in by_name.most_common(12)]
    return gdn_ms, total_ms, top, gdn_top


def _busy_us(events):
    """us during which at least one of ``events`` runs (the union of their intervals)."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.time_range.start):
        start = max(e.time_range.start, end)
        if e.time_range.end > start:
            busy += e.time_range.end - start
        end = max(end, e.time_range.end)
    return busy


def _below_gdn(event):
    while event is not None:
        if event.key in GDN_OPS:
            return True
        event = event.cpu_parent
    return False


def _launches(events, kernels):
    """A CPU op's id -> the kernels it launched. By the kernel's correlation id where the profiler gives it (torch
    2.13); else (torch 2.11) by the (name, duration) records a CPU op keeps of its kernels, matched to the kernel
    events one by one in time order."""
    import collections

    launched_by = collections.defaultdict(list)
    if kernels and hasattr(kernels[0], "linked_correlation_id"):
        for e in kernels:
            launched_by[e.linked_correlation_id].append(e)
        return launched_by
    by_record = collections.defaultdict(collections.deque)
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        by_record[e.name, e.time_range.end - e.time_range.start].append(e)
    for event in sorted(events, key=lambda e: e.time_range.start):
        for record in getattr(event, "kernels", ()):
            match = by_record.get((record.name, record.duration))
            if match:
                launched_by[event.id].append(match.popleft())
    return launched_by


def _kernels_below(event, launched_by):
    """The kernels launched below the CPU op ``event`` (``launched_by``: a CPU op's id -> its kernels)."""
    yield from launched_by.get(event.id, ())
    for child in event.cpu_children:
        yield from _kernels_below(child, launched_by)


def worker(args):
    """Run one group's paths; write rows and profiles as JSON to ``args.result``."""
    import torch

    rows, profiles = [], []
    gdn_binding()  # cached before any path rebinds it
    for model_kind in args.models.split(","):
        model = build(model_kind)
        grad_param = model.model.layers[0].linear_attn.in_proj_qkvz.weight
        for path in GROUPS[args.worker]:
            if path not in args.paths.split(","):
                continue
            torch._dynamo.reset()
            with gdn_bound_to_fla() if path == "inductor-fla" else contextlib.nullcontext():
                fn = model if path == "eager-fla" else compiled(model, path)
                measure(args, model, model_kind, grad_param, path, fn, rows, profiles)
                del fn
        del model, grad_param
        torch.cuda.empty_cache()


def measure(args, model, model_kind, grad_param, path, fn, rows, profiles):
    """One path's rows (and profiles) for every kind and length, appended to ``rows`` / ``profiles``."""
    import torch

    lengths = [int(t) for t in args.lengths.split(",")]
    for kind in args.kinds.split(","):
        for i, T in enumerate(lengths):
            breaks0, graphs0 = dynamo_counts()
            ids = torch.randint(0, 4096, (1, T), generator=torch.Generator().manual_seed(T)).cuda()
            step = step_fn(model, fn, ids, kind, cuda_graphs=path == "qla-reduce-overhead")
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = step()
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            logits, grad = logits[:, ::TOKEN_STRIDE].float().cpu(), None
            if kind == "train":
                grad = grad_param.grad[::ROW_STRIDE].float().cpu()
            ref = os.path.join(args.refs, f"{model_kind}-{T}-{kind}.pt")
            check = {}
            if path == "eager-fla":
                torch.save((logits, grad), ref)
            elif os.path.exists(ref):
                ref_logits, ref_grad = torch.load(ref)
                check["logits_vs_eager_fla"] = rel_l2(logits, ref_logits)
                if grad is not None:
                    check["grad_vs_eager_fla"] = rel_l2(grad, ref_grad)
            del logits, grad
            step()  # a second warm-up (CUDA-graph paths record here)
            ms = median_ms(step, args.reps, args.rounds)
            breaks, graphs = dynamo_counts()
            rows.append(dict(model=model_kind, T=T, kind=kind, path=path, ms=round(ms, 3),
                             first_call_s=round(first, 2), graph_breaks=breaks - breaks0,
                             graphs=graphs - graphs0, **{k: float(f"{v:.3e}") for k, v in check.items()}))
            print(json.dumps(rows[-1]), flush=True)
            if i == 0 and args.profile:
                gdn_ms, total_ms, top, gdn_top = profile_step(step)
                share = None if path == "qla-reduce-overhead" else gdn_ms / total_ms  # replays: no ops
                profiles.append(dict(model=model_kind, T=T, kind=kind, path=path, gdn_share=share,
                                     device_ms=round(total_ms, 3), top=top, gdn_top=gdn_top))
            save(args.result, rows, profiles)  # after every row: a group stopped by --budget-s keeps it
            del step, ids
            torch.cuda.empty_cache()


def save(result, rows, profiles):
    with open(result + ".part", "w") as f:
        json.dump(dict(rows=rows, profiles=profiles, meta={"transformers_gdn": gdn_binding()}), f)
    os.replace(result + ".part", result)


def render(rows, profiles, meta):
    lines = [f"# Model level, {meta['gpu']}, {datetime.date.today().isoformat()}", "",
             "Qwen3-Next-shaped transformers model (bench/model.py): median step ms, first call s, graphs and "
             "graph breaks dynamo counted while compiling at that length, relative L2 of logits / in_proj_qkvz "
             "grad vs eager-fla.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"transformers' GDN function dispatches to: {meta['transformers_gdn']}", "",
             "| model | T | kind | path | ms | vs eager-fla | vs inductor-fla | first call s | graphs | breaks | "
             "logits err | grad err |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["T"], r["kind"], r["path"]): r["ms"] for r in rows}
    for r in rows:
        key = (r["model"], r["T"], r["kind"])
        ratio = lambda p: f"{base[(*key, p)] / r['ms']:.2f}" if (*key, p) in base else "-"
        lines.append(f"| {r['model']} | {r['T']} | {r['kind']} | {r['path']} | {r['ms']} | {ratio('eager-fla')} | "
                     f"{ratio('inductor-fla')} | {r['first_call_s']} | {r['graphs']} | {r['graph_breaks']} | "
                     f"{r.get('logits_vs_eager_fla', '-')} | {r.get('grad_vs_eager_fla', '-')} |")
    lines += ["", "## Where the time goes (one profiled step at the first length)", ""]
    for p in profiles:
        share = "n/a (CUDA graph)" if p["gdn_share"] is None else f"{100 * p['gdn_share']:.1f}%"
        lines.append(f"- {p['model']} {p['kind']} T={p['T']} {p['path']}: device {p['device_ms']} ms, GDN ops {share}; "
                     "top kernels: " + "; ".join(f"{n} {ms}" for n, ms in p["top"][:8]))
    return "\n".join(lines) + "\n"


def merged(out, rows, profiles):
    """``rows`` and ``profiles`` with those of earlier runs in ``out`` that this run did not measure (a run may
    cover some paths, models or lengths only)."""
    key = lambda r: (r["model"], r["T"], r["kind"], r["path"])
    for name, new in (("latest-model.json", rows), ("latest-model-profiles.json", profiles)):
        path = os.path.join(out, name)
        if os.path.exists(path):
            with open(path) as f:
                done = {key(r) for r in new}
                new += [r for r in json.load(f) if key(r) not in done]
    order = {p: i for i, p in enumerate(GROUPS["fla"] + GROUPS["qla"])}
    for new in (rows, profiles):
        new.sort(key=lambda r: (r["model"], r["kind"], r["T"], order[r["path"]]))
    return rows, profiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--kinds", default="prefill,train")
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=float("inf"),
                    help="stop the run after this many seconds, keeping the rows finished by then")
    ap.add_argument("--refs", default=REF_DIR, help="eager-fla's logits and gradient samples (written, then read)")
    ap.add_argument("--worker", choices=sorted(GROUPS))
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.refs, exist_ok=True)
    rows, profiles, meta = [], [], {}
    deadline = time.monotonic() + args.budget_s
    for group in [g for g, paths in GROUPS.items() if set(paths) & set(args.paths.split(","))]:
        result = os.path.join(args.out, f"model-{group}.json")
        if os.path.exists(result):
            os.remove(result)
        env = {**os.environ, "FLA_FLASH_QLA": "0", "FLA_QLA_COMPILE": "0" if group == "fla" else "1",
               "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(), "TRITON_CACHE_DIR": tempfile.mkdtemp()}
        cmd = [sys.executable, __file__, "--worker", group, "--result", result] + [
            f"--{k}={getattr(args, k)}" for k in ("models", "lengths", "kinds", "paths", "reps", "rounds", "refs")] + (
            ["--profile"] if args.profile else [])
        try:
            left = deadline - time.monotonic()
            subprocess.run(cmd, env=env, check=True, timeout=None if left == float("inf") else max(1.0, left))
        except subprocess.TimeoutExpired:
            print(f"--budget-s reached: the {group} group stopped; its finished rows are kept", flush=True)
        if not os.path.exists(result):
            continue
        with open(result) as f:
            part = json.load(f)
        rows += part["rows"]
        profiles += part["profiles"]
        meta.update(part["meta"])
    meta.setdefault("transformers_gdn", "?")
    meta["versions"] = versions()
    import transformers

    meta["versions"]["transformers"] = transformers.__version__
    meta["gpu"] = meta["versions"]["gpu"]
    rows, profiles = merged(args.out, rows, profiles)
    with open(os.path.join(args.out, "latest-model.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "latest-model-profiles.json"), "w") as f:
        json.dump(profiles, f, indent=1)
    with open(os.path.join(args.out, f"{datetime.date.today().isoformat()}-model.md"), "w") as f:
        f.write(render(rows, profiles, meta))
    print(render(rows, profiles, meta))


if __name__ == "__main__":
    main()
