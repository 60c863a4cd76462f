"""The input activations of eager Hopper calls as fused Triton passes in fp32 (the math of ``reference.activate``
/ ``activation_bwd``): the L2 norm of q and k (forward; its backward is formed in the backward kernels), FLA's
gate activation and beta's sigmoid (forward and backward).

* :func:`l2norm`: ``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim of q and k, read from strided ``[B, T, H, D]``
  views (the split of a fused qkv projection, or of transformers' transposed convolution output) and written
  contiguous in their dtype, as the TileLang kernels take them, with each row's rstd; v, the third slice of that
  projection, is made contiguous in the same launch. Its backward is formed in the backward kernels from the
  normalised rows and their rstd (``chunk_grads``' ``l2norm``), as FLA's layer keeps the same. In torch ops
  the norm is five to eight passes over fp32 copies.
* :func:`gates` / :func:`gates_bwd`: ``g <- -exp(A_log) * softplus(g + dt_bias)`` and ``beta <- sigmoid(beta)``
  (doubled with ``allow_neg_eigval``) in one launch each way instead of a dozen small ops.

Traced calls do not come here: there these are graph ops that Inductor fuses (``api.op_call(lift=True)``).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..reference import L2NORM_EPS, GDROptions

_ROWS = 32  # rows of D elements per program
_BLOCK = 1024  # gate elements per program


@triton.jit
def _rows(pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, HEAD_MAJOR: tl.constexpr, ROWS: tl.constexpr):
    """A program's rows ``(token, head)`` of a strided ``[B, T, H, D]`` tensor: their index in the dense
    ``[B*T*H, D]`` output, whether they exist, their offsets in the tensor. Rows go token by token, or head by
    head (``HEAD_MAJOR``) where tokens lie closer together than a row's elements (a transposed ``[B, D, T]``
    convolution output), so that a program reads neighbouring tokens."""
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    if HEAD_MAJOR:
        n_tok = n_rows // heads
        head, tok = rows // n_tok, rows % n_tok
    else:
        tok, head = rows // heads, rows % heads
    src = (tok // seq_len) * stride_b + (tok % seq_len) * stride_t + head * stride_h
    return tok * heads + head, rows < n_rows, src


@triton.jit
def _l2norm_rows(x_ptr, y_ptr, r_ptr, pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, stride_d, eps,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_MAJOR: tl.constexpr, ROWS: tl.constexpr):
    rows, live, src = _rows(pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, HEAD_MAJOR, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + src[:, None] + cols[None, :].to(tl.int64) * stride_d, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + rows, rstd, mask=live)


@triton.jit
def _copy_rows(x_ptr, y_ptr, pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, stride_d, D: tl.constexpr,
               BLOCK_D: tl.constexpr, HEAD_MAJOR: tl.constexpr, ROWS: tl.constexpr):
    rows, live, src = _rows(pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, HEAD_MAJOR, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < D)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :],
             tl.load(x_ptr + src[:, None] + cols[None, :].to(tl.int64) * stride_d, mask=mask), mask=mask)


@triton.jit
def _l2norm_fwd(x0_ptr, y0_ptr, r0_ptr, x1_ptr, y1_ptr, r1_ptr, per_x, n_rows, heads, seq_len, stride_b, stride_t,
                stride_h, stride_d, c_ptr, co_ptr, n_c_rows, c_heads, c_stride_b, c_stride_t, c_stride_h, c_stride_d,
                eps, D: tl.constexpr, BLOCK_D: tl.constexpr, DC: tl.constexpr, BLOCK_DC: tl.constexpr,
                N_X: tl.constexpr, HEAD_MAJOR: tl.constexpr, C_HEAD_MAJOR: tl.constexpr, ROWS: tl.constexpr):
    """Programs ``[0, per_x)`` normalise x0 into y0 (rstd into r0), with ``N_X == 2`` the next ``per_x`` x1
    into y1 (q and k in one launch), the rest copy c into co (v made contiguous in the same launch)."""
    pid = tl.program_id(0)
    if pid < per_x:
        _l2norm_rows(x0_ptr, y0_ptr, r0_ptr, pid, n_rows, heads, seq_len, stride_b, stride_t, stride_h, stride_d,
                     eps, D, BLOCK_D, HEAD_MAJOR, ROWS)
    elif N_X == 2 and pid < 2 * per_x:
        _l2norm_rows(x1_ptr, y1_ptr, r1_ptr, pid - per_x, n_rows, heads, seq_len, stride_b, stride_t, stride_h,
                     stride_d, eps, D, BLOCK_D, HEAD_MAJOR, ROWS)
    else:
        _copy_rows(c_ptr, co_ptr, pid - N_X * per_x, n_c_rows, c_heads, seq_len, c_stride_b, c_stride_t,
                   c_stride_h, c_stride_d, DC, BLOCK_DC, C_HEAD_MAJOR, ROWS)


def _on(device):
    """The tensors' device made current where it is not: Triton launches on the current device's stream (a CPU
    device: Triton's interpreter, in the tests)."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _head_major(x) -> bool:
    """Whether :func:`_rows` should take ``x``'s rows head by head: its tokens lie closer than its elements."""
    return x.stride(1) < x.stride(3)


def l2norm(*xs: torch.Tensor, copy: torch.Tensor | None = None):
    """The L2-normalised rows of one or two tensors ``[B, T, H, D]`` of any strides (q and k: one launch where
    they share a shape and strides), computed in fp32, contiguous, in their dtypes; with ``copy`` (v,
    ``[B, T, H', D']``) also that tensor made contiguous in the same launch (returned as is where it is).
    Returns ``(ys, rstds, copied)``: each row's ``rsqrt(sum(x^2) + eps)`` fp32 ``[B*T*H]`` (what the backward
    kernels take) and the copy (None without ``copy``)."""
    if len(xs) == 2 and (xs[0].shape != xs[1].shape or xs[0].stride() != xs[1].stride()):
        (y0,), (r0,), copied = l2norm(xs[0], copy=copy)  # layouts differ: one launch each
        (y1,), (r1,), _ = l2norm(xs[1])
        return (y0, y1), (r0, r1), copied
    x = xs[0]
    B, T, H, D = x.shape
    n_rows = B * T * H
    ys = tuple(torch.empty(x.shape, device=x.device, dtype=x.dtype) for _ in xs)
    rstds = tuple(torch.empty(n_rows, device=x.device, dtype=torch.float32) for _ in xs)
    c = x if copy is None else copy  # no copy: a spare for its arguments, never read
    copied = None if copy is None else (c if c.is_contiguous() else torch.empty(c.shape, device=c.device,
                                                                               dtype=c.dtype))
    n_c_rows = 0 if copied is None or copied is c else c.shape[0] * c.shape[1] * c.shape[2]
    per_x = triton.cdiv(n_rows, _ROWS)
    grid = per_x * len(xs) + triton.cdiv(n_c_rows, _ROWS)
    args = [a for x_i, y, rstd in zip(xs, ys, rstds) for a in (x_i, y, rstd)]
    if grid:
        with _on(x.device):
            _l2norm_fwd[(grid,)](*(args * 2)[:6], per_x, n_rows, H, T, *x.stride(), c,
                                 c if copied is None else copied, n_c_rows, c.shape[2], *c.stride(), L2NORM_EPS,
                                 D=D, BLOCK_D=triton.next_power_of_2(D), DC=c.shape[3],
                                 BLOCK_DC=triton.next_power_of_2(c.shape[3]), N_X=len(xs),
                                 HEAD_MAJOR=_head_major(x), C_HEAD_MAJOR=_head_major(c), ROWS=_ROWS, num_warps=4)
    return ys, rstds, copied


@triton.jit
def _softplus(x):
    """``log(1 + e^x)`` as ``max(x, 0) + log1p(e^-|x|)``, log1p by Kahan's ``log(w) * u / (w - 1)``."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    return tl.maximum(x, 0.0) + tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))


@triton.jit
def _gates_fwd(g_ptr, b_ptr, a_log_ptr, dt_ptr, go_ptr, bo_ptr, n, heads, beta_scale, GATE: tl.constexpr,
               HAS_DT: tl.constexpr, SIGMOID: tl.constexpr, BLOCK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = offs < n
    g = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if GATE:
        h = offs % heads
        if HAS_DT:
            g += tl.load(dt_ptr + h, mask=live, other=0.0).to(tl.float32)
        g = -tl.exp(tl.load(a_log_ptr + h, mask=live, other=0.0).to(tl.float32)) * _softplus(g)
    tl.store(go_ptr + offs, g, mask=live)
    b = tl.load(b_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if SIGMOID:
        b = beta_scale * tl.sigmoid(b)
    tl.store(bo_ptr + offs, b, mask=live)


@triton.jit
def _gates_bwd(g_ptr, b_ptr, a_log_ptr, dt_ptr, dga_ptr, dba_ptr, dg_ptr, db_ptr, part_ptr, n_tok, heads,
               s_dga_t, s_dga_h, s_dba_t, s_dba_h, beta_scale, GATE: tl.constexpr, HAS_DT: tl.constexpr,
               SIGMOID: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """``TOK`` tokens x every head per program; ``dga``, ``dba`` read at any strides (the kernels' head-major
    gradients); the parameters' gradients summed over the program's tokens into its row of ``part``
    (``[programs, 2, HB]``: dA_log's, dt_bias's)."""
    pid = tl.program_id(0)
    tok = (pid * TOK + tl.arange(0, TOK)).to(tl.int64)[:, None]
    h = tl.arange(0, HB)
    live = (tok < n_tok) & (h[None, :] < heads)
    dense = tok * heads + h[None, :]
    dg = tl.load(dga_ptr + tok * s_dga_t + h[None, :] * s_dga_h, mask=live, other=0.0).to(tl.float32)
    if GATE:
        x = tl.load(g_ptr + dense, mask=live, other=0.0).to(tl.float32)
        if HAS_DT:
            x += tl.load(dt_ptr + h, mask=h < heads, other=0.0).to(tl.float32)[None, :]
        neg_a = -tl.exp(tl.load(a_log_ptr + h, mask=h < heads, other=0.0).to(tl.float32))[None, :]
        tl.store(part_ptr + pid * 2 * HB + h, tl.sum(dg * neg_a * _softplus(x), axis=0))  # d/dA_log, masked: 0
        dg = dg * neg_a * tl.sigmoid(x)
        if HAS_DT:
            tl.store(part_ptr + pid * 2 * HB + HB + h, tl.sum(dg, axis=0))
    tl.store(dg_ptr + dense, dg.to(dg_ptr.dtype.element_ty), mask=live)
    db = tl.load(dba_ptr + tok * s_dba_t + h[None, :] * s_dba_h, mask=live, other=0.0).to(tl.float32)
    if SIGMOID:
        sig = tl.sigmoid(tl.load(b_ptr + dense, mask=live, other=0.0).to(tl.float32))
        db = db * sig * (1.0 - sig) * beta_scale
    tl.store(db_ptr + dense, db.to(db_ptr.dtype.element_ty), mask=live)


def _params(A_log, dt_bias, spare):
    """``A_log, dt_bias`` as kernel arguments, ``spare`` standing in for an absent one (never read)."""
    return (spare if A_log is None else A_log), (spare if dt_bias is None else dt_bias)


def _gate_flags(dt_bias, opts: GDROptions):
    """The options' arguments of both gate kernels."""
    gate = opts.use_gate_in_kernel
    return dict(beta_scale=2.0 if opts.allow_neg_eigval else 1.0, GATE=gate, HAS_DT=gate and dt_bias is not None,
                SIGMOID=opts.use_beta_sigmoid_in_kernel, num_warps=4)


def gates(g, beta, A_log, dt_bias, opts: GDROptions):
    """The log gate and beta the recurrence uses, fp32 ``[B, T, H_v]`` contiguous (``reference.activate_gates``
    with ``dtype=float32``)."""
    if not (opts.use_gate_in_kernel or opts.use_beta_sigmoid_in_kernel):  # no-ops where they are already
        return g.float().contiguous(), beta.float().contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    go = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    bo = torch.empty(beta.shape, device=beta.device, dtype=torch.float32)
    if g.numel():
        with _on(g.device):
            _gates_fwd[(triton.cdiv(g.numel(), _BLOCK),)](g, beta, *_params(A_log, dt_bias, go), go, bo,
                                                          n=g.numel(), heads=g.shape[-1], BLOCK=_BLOCK,
                                                          **_gate_flags(dt_bias, opts))
    return go, bo


def gates_bwd(g, beta, A_log, dt_bias, opts: GDROptions, dga, dba):
    """``(dg, dbeta, dA_log, ddt_bias)`` from the gradients ``dga, dba`` of :func:`gates`' outputs (``[B, T, H]``
    of any strides, as the kernels' backward gives them), in the inputs' dtypes (None where a parameter is not
    used): one launch, the parameters' sums over tokens in fp32 per program and then over programs."""
    if not (opts.use_gate_in_kernel or opts.use_beta_sigmoid_in_kernel):
        return dga.to(g.dtype), dba.to(beta.dtype), None, None
    g, beta = g.contiguous(), beta.contiguous()
    n_tok, heads = g.numel() // g.shape[-1], g.shape[-1]
    dg = torch.empty(g.shape, device=g.device, dtype=g.dtype)
    db = torch.empty(beta.shape, device=beta.device, dtype=beta.dtype)
    hb = triton.next_power_of_2(heads)
    tok = max(1, _BLOCK // hb)
    n_prog = triton.cdiv(n_tok, tok)
    part = torch.empty(n_prog, 2, hb, device=g.device, dtype=torch.float32)  # every row that is read is written
    dga2, dba2 = dga.reshape(n_tok, heads), dba.reshape(n_tok, heads)  # views of the kernels' head-major layout
    if n_tok:
        with _on(g.device):
            _gates_bwd[(n_prog,)](g, beta, *_params(A_log, dt_bias, dg), dga2, dba2, dg, db, part, n_tok,
                                  heads, *dga2.stride(), *dba2.stride(), TOK=tok, HB=hb,
                                  **_gate_flags(dt_bias, opts))
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        sums = part.sum(0)
        dA_log = sums[0, :heads].to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = sums[1, :heads].to(dt_bias.dtype)
    return dg, db, dA_log, ddt_bias
