"""Per-chunk instruction mix of SM90 kernels, read from their SASS on a machine without a GPU (issue 20: what each
warpgroup's chunk loop issues, ours next to FlashInfer 0.7's).

    python bench/sass_loops.py ours                           # the split-state recurrence's variants (prebuilt)
    python bench/sass_loops.py fi07 --site DIR                # FlashInfer 0.7's SM90 prefill, compiled here
    python bench/sass_loops.py file K.cubin [...]             # any cubins
    python bench/sass_loops.py opdiff TREE_A TREE_B            # per loop, the opcodes whose counts differ

``ours`` takes the shipped binaries of ``split_state_recurrence.chunk_fwd_split`` (bf16, h0; T~ and on-chip A_g,
free and ordered issue where the package has them). ``fi07`` compiles FlashInfer 0.7's CuTe-DSL kernel for sm_90a
on CPU tensors (nothing runs; ``DIR`` holds flashinfer-python and nvidia-cutlass-dsl for this Python, e.g. from
``pip download --python-version 3.11 ...`` of the versions in ``bench/flashinfer07_bundle.sh``, plus cuda-bindings).
Needs ``nvdisasm`` (``--nvdisasm``, default: on PATH).

A loop is a backward branch before the kernel's last EXIT (after it sit out-of-line stubs that jump back) that is not
an mbarrier wait's retry; loops shorter than ``--min`` instructions are left out. "One iteration" is the shortest path
from a loop's head to its back edge: our loop bodies hold an arm per ring stage, of which one runs per chunk.
"""

import argparse
import collections
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLASSES = [  # (column, opcode regex), first match wins
    ("HGMMA", r"HGMMA"), ("HMMA", r"HMMA"), ("MUFU", r"MUFU"), ("LDSM", r"LDSM"), ("STSM", r"STSM"),
    ("LDS", r"LDS"), ("STS", r"STS"), ("LDG/STG", r"LDG|STG"), ("LDL/STL (spills)", r"LDL|STL"),
    ("bar", r"BAR|SYNCS|WARPGROUP"),
    ("F2FP", r"F2FP"), ("FMUL/FFMA/FADD", r"FMUL|FFMA|FADD"), ("HFMA2", r"HMUL2|HFMA2|HADD2"),
    ("int", r"IMAD|IADD|LEA|ISETP|PRMT|SHF|LOP3|SEL|MOV"), ("uniform", r"U"),
]


def disassemble(cubin, nvdisasm):
    out = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    code, labels = [], {}
    for line in out.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            text = m.group(2)
            bare = re.sub(r"^@!?U?P\w+\s+", "", text)
            code.append((int(m.group(1), 16), bare, bare != text))
        elif re.match(r"^\.L_x_\d+:", line):
            labels[line.split(":")[0]] = len(code)
    return code, labels


def loops(code, labels, min_len):
    """``(start, end)`` indices of the backward branches' bodies of at least ``min_len`` instructions (branches after
    the last EXIT are the return jumps of out-of-line stubs, not loops)."""
    found = set()
    last_exit = max(i for i, (_, text, _) in enumerate(code) if text.startswith("EXIT"))
    for i, (_, text, _) in enumerate(code[:last_exit]):
        m = re.match(r"BRA\s+`\((\.L_x_\d+)\)", text)
        retry = any("SYNCS.PHASECHK" in t for _, t, _ in code[max(0, i - 3):i])
        if m and labels.get(m.group(1), i + 1) <= i and not retry and i - labels[m.group(1)] + 1 >= min_len:
            found.add((labels[m.group(1)], i))
    return sorted(found)


def shortest_path(code, labels, s, e):
    """Instructions on the shortest path from the loop head ``s`` to its back edge ``e``: one iteration as executed
    where the body's branches are alternatives (per-stage arms, a full chunk's store against a partial one's)."""
    def successors(i):
        text = code[i][1]
        m = re.match(r"BRA(?:\.\w+)?\s+(?:\w+,\s*)?`\((\.L_x_\d+)\)", text)
        out = []
        if m and labels.get(m.group(1)) is not None and s <= labels[m.group(1)] <= e:
            out.append(labels[m.group(1)])
        conditional = code[i][2]
        if not (text.startswith("EXIT") or (m and not conditional)) and i + 1 <= e:
            out.append(i + 1)
        return out

    dist, heap = {s: 1}, [(1, s)]
    while heap:
        d, i = heapq.heappop(heap)
        if i == e:
            return d
        if d > dist.get(i, 1 << 30):
            continue
        for j in successors(i):
            if d + 1 < dist.get(j, 1 << 30):
                dist[j] = d + 1
                heapq.heappush(heap, (d + 1, j))
    return None


def mix(body):
    counts = collections.Counter()
    for _, text, _ in body:
        op = text.split()[0]
        counts[next((name for name, rx in CLASSES if re.match(rx, op)), "other")] += 1
    return counts


def report(name, cubin, nvdisasm, min_len):
    code, labels = disassemble(cubin, nvdisasm)
    cols = [c for c, _ in CLASSES] + ["other"]
    print(f"\n{name} ({len(code)} instructions)\n")
    print("| loop | instructions | one iteration | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for s, e in loops(code, labels, min_len):
        c = mix(code[s:e + 1])
        print(f"| {code[s][0]:#x}-{code[e][0]:#x} | {e - s + 1} | {shortest_path(code, labels, s, e)} | "
              + " | ".join(str(c[k]) for k in cols) + " |")


def ours(root=ROOT):
    """``(label, cubin)`` of the split-state variants (bf16 with h0, no trace) that the tree at ``root`` ships,
    unpacked into a temporary folder."""
    prebuilt = os.path.join(root, "qla_compile", "kernels", "prebuilt")
    with open(os.path.join(prebuilt, "manifest.json")) as f:
        variants = json.load(f)["variants"]
    tmp = tempfile.mkdtemp()
    archive = tarfile.open(os.path.join(prebuilt, "kernels.tar.xz"))
    for v in variants:
        p = v["params"]
        if v["kernel"] == "chunk_fwd_split" and p["dtype"] == "bfloat16" and p["has_h0"] and not p.get("trace"):
            data = archive.extractfile(f"{v['key']}/executable.so").read()
            path = os.path.join(tmp, v["key"][:12] + ".cubin")
            with open(path, "wb") as f:
                f.write(data[data.find(b"\x7fELF", 1):])  # the cubin is the second ELF image in the module
            label = ", ".join(f"{k}={p[k]}" for k in ("inverse", "cu_dtype") if k in p)
            yield f"chunk_fwd_split({label})", path


def opdiff(tree_a, tree_b, nvdisasm, min_len):
    """Per variant both trees ship and per loop (paired in address order), the opcodes whose counts differ: where a
    source change moved the compiled loops (e.g. work ptxas no longer keeps in uniform registers)."""
    b_cubins = dict(ours(tree_b))
    for label, a_cubin in ours(tree_a):
        if label not in b_cubins:
            continue
        bodies = []
        for cubin in (a_cubin, b_cubins[label]):
            code, labels = disassemble(cubin, nvdisasm)
            bodies.append([collections.Counter(t.split()[0] for _, t, _ in code[s:e + 1])
                           for s, e in loops(code, labels, min_len)])
        print(f"\n{label}: loops {len(bodies[0])} / {len(bodies[1])}")
        for n, (a, b) in enumerate(zip(*bodies)):
            moved = sorted((b[op] - a[op], op) for op in set(a) | set(b) if a[op] != b[op])
            print(f"  loop {n}: {sum(a.values())} -> {sum(b.values())} instructions; "
                  + (", ".join(f"{op} {d:+d}" for d, op in moved) or "the same opcodes"))


def fi07(site):
    """FlashInfer 0.7's SM90 GDN prefill (bf16, alpha, beta, h0; 32 heads) compiled for sm_90a, its cubin path."""
    sys.path[:0] = [os.path.join(site, "nvidia_cutlass_dsl", "dsl_packages"), site]
    import torch
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as driver
    from cutlass.base_dsl.compiler import DumpDir, KeepCUBIN
    from flashinfer.gdn_kernels.delta_rule_dsl import delta_rule_sm90 as fi

    h, d, n_tok, n_seq = 32, 128, 4096, 2
    q, k, v = (torch.randn(n_tok, h, d, dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(v)
    state, init = torch.empty(n_seq, h, d, d), torch.zeros(n_seq, h, d, d)
    alpha, beta = torch.rand(n_tok, h), torch.rand(n_tok, h)
    cu = torch.tensor([0, n_tok // 2, n_tok], dtype=torch.int64)
    raw = torch.empty(132 * 128 + 128, dtype=torch.uint8)  # the tensor-map workspace, 128-byte aligned
    maps = raw[(-raw.data_ptr()) % 128:][:132 * 128]
    kernel = fi._get_prefill_kernel(True, True, True, False, cutlass.BFloat16, initial_state_dtype=torch.float32,
                                    state_dtype=torch.float32, checkpoint_state_dtype=torch.float32,
                                    use_state_indices=False, cu_seqlens_dtype=torch.int64, state_indices_dtype=None,
                                    checkpoint_cu_starts_dtype=None, state_inner_strides=None,
                                    init_state_inner_strides=None)
    dl = lambda t, align: cute.runtime.from_dlpack(t, assumed_align=align, enable_tvm_ffi=True)
    args = (dl(q.as_strided((n_tok, d, h), (h * d, 1, d)), 16).mark_layout_dynamic(leading_dim=1),
            *(dl(t.as_strided((d, n_tok, h), (1, h * d, d)), 16).mark_layout_dynamic(leading_dim=0) for t in (k, v, o)),
            dl(alpha.reshape(-1), 16).mark_layout_dynamic(), dl(beta.reshape(-1), 16).mark_layout_dynamic(),
            dl(state, 16).mark_layout_dynamic(), dl(init, 16).mark_layout_dynamic(), None, None, None,
            dl(maps, 128).mark_layout_dynamic(), dl(cu, 8).mark_layout_dynamic(), cutlass.Float32(d ** -0.5),
            *(cutlass.Int32(x) for x in (h, h, h, h, n_seq, 1, 0)), n_seq * h, driver.CUstream(0))
    out = tempfile.mkdtemp()
    cubin = cute.compile[fi._SM90_COMPILE_OPTIONS + (KeepCUBIN(True), DumpDir(out))](kernel, *args).artifacts.CUBIN
    if isinstance(cubin, bytes):  # the image itself rather than its path
        with open(os.path.join(out, "fi07.cubin"), "wb") as f:
            f.write(cubin)
        cubin = f.name
    return cubin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["ours", "fi07", "file", "opdiff"])
    ap.add_argument("cubins", nargs="*")
    ap.add_argument("--site", help="fi07: the folder holding flashinfer and nvidia_cutlass_dsl")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    ap.add_argument("--min", type=int, default=150, help="shortest loop body reported (instructions)")
    a = ap.parse_args(argv)
    if a.what == "opdiff":
        return opdiff(*a.cubins, a.nvdisasm, a.min)
    if a.what == "ours":
        items = list(ours())
    elif a.what == "fi07":
        items = [("FlashInfer 0.7 delta_rule_sm90 (bf16, alpha, beta, h0)", fi07(a.site))]
    else:
        items = [(os.path.basename(p), p) for p in a.cubins]
    for name, cubin in items:
        report(name, cubin, a.nvdisasm, a.min)


if __name__ == "__main__":
    main()
