"""The input activations of eager Hopper calls as fused Triton passes in fp32, forward and backward: the L2 norm
of q and k, FLA's gate activation and beta's sigmoid (the math of ``reference.activate`` / ``activation_bwd``).

* :func:`l2norm`: ``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim of q and k, read from strided ``[B, T, H, D]``
  views (the split of a fused qkv projection, or of transformers' transposed convolution output) and written
  contiguous in their dtype, as the TileLang kernels take them, with each row's rstd; v, the third slice of that
  projection, is made contiguous in the same launch.
  :func:`l2norm_bwd` takes the normalised rows, their rstd and their gradient (FLA's layer keeps the same). In
  torch ops each is five to eight passes over fp32 copies.
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


@triton.jit
def _l2norm_bwd_rows(y_ptr, r_ptr, dy_ptr, dx_ptr, pid, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROWS: tl.constexpr):
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    live = rows < n_rows
    mask = live[:, None] & (cols[None, :] < D)
    dense = rows[:, None] * D + cols[None, :]
    y = tl.load(y_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(r_ptr + rows, mask=live, other=0.0)
    dx = rstd[:, None] * (dy - y * tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + dense, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_bwd(y0_ptr, r0_ptr, dy0_ptr, dx0_ptr, y1_ptr, r1_ptr, dy1_ptr, dx1_ptr, per_x, n_rows,
                D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    if pid < per_x:
        _l2norm_bwd_rows(y0_ptr, r0_ptr, dy0_ptr, dx0_ptr, pid, n_rows, D, BLOCK_D, ROWS)
    else:
        _l2norm_bwd_rows(y1_ptr, r1_ptr, dy1_ptr, dx1_ptr, pid - per_x, n_rows, D, BLOCK_D, ROWS)


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
    Returns ``(ys, rstds, copied)``: each row's ``rsqrt(sum(x^2) + eps)`` fp32 ``[B*T*H]`` (what
    :func:`l2norm_bwd` takes) and the copy (None without ``copy``)."""
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


def l2norm_bwd(*triples: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The gradients of :func:`l2norm`'s inputs, for one or two triples ``(y, rstd, dy)`` of its output, its rstd
    and the output's gradient (two of one shape: one launch), contiguous, in ``y``'s dtype."""
    if len(triples) == 2 and triples[0][0].shape != triples[1][0].shape:
        return l2norm_bwd(triples[0]) + l2norm_bwd(triples[1])
    y = triples[0][0]
    n_rows, D = y.numel() // y.shape[-1], y.shape[-1]
    dxs = tuple(torch.empty(y.shape, device=y.device, dtype=y.dtype) for _ in triples)
    args = [a for (y_i, rstd, dy), dx in zip(triples, dxs) for a in (y_i, rstd, dy.contiguous(), dx)]
    per_x = triton.cdiv(n_rows, _ROWS)
    if n_rows:
        with _on(y.device):
            _l2norm_bwd[(per_x * len(triples),)](*(args * 2)[:8], per_x, n_rows, D=D,
                                                 BLOCK_D=triton.next_power_of_2(D), ROWS=_ROWS, num_warps=4)
    return dxs


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
def _gates_bwd(g_ptr, b_ptr, a_log_ptr, dt_ptr, dga_ptr, dba_ptr, dg_ptr, db_ptr, da_ptr, n, heads, beta_scale,
               GATE: tl.constexpr, HAS_DT: tl.constexpr, SIGMOID: tl.constexpr, BLOCK: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    live = offs < n
    dg = tl.load(dga_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if GATE:
        h = offs % heads
        x = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
        if HAS_DT:
            x += tl.load(dt_ptr + h, mask=live, other=0.0).to(tl.float32)
        neg_a = -tl.exp(tl.load(a_log_ptr + h, mask=live, other=0.0).to(tl.float32))
        tl.store(da_ptr + offs, dg * neg_a * _softplus(x), mask=live)  # d/dA_log of neg_a * softplus(x)
        dg = dg * neg_a * tl.sigmoid(x)
    tl.store(dg_ptr + offs, dg, mask=live)
    db = tl.load(dba_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if SIGMOID:
        s = tl.sigmoid(tl.load(b_ptr + offs, mask=live, other=0.0).to(tl.float32))
        db = db * s * (1.0 - s) * beta_scale
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=live)


def _params(A_log, dt_bias, spare):
    """``A_log, dt_bias`` as kernel arguments, ``spare`` standing in for an absent one (never read)."""
    return (spare if A_log is None else A_log), (spare if dt_bias is None else dt_bias)


def _gate_args(g, dt_bias, opts: GDROptions):
    gate = opts.use_gate_in_kernel
    return dict(n=g.numel(), heads=g.shape[-1], beta_scale=2.0 if opts.allow_neg_eigval else 1.0, GATE=gate,
                HAS_DT=gate and dt_bias is not None, SIGMOID=opts.use_beta_sigmoid_in_kernel, BLOCK=_BLOCK,
                num_warps=4)


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
                                                          **_gate_args(g, dt_bias, opts))
    return go, bo


def gates_bwd(g, beta, A_log, dt_bias, opts: GDROptions, dga, dba):
    """``(dg, dbeta, dA_log, ddt_bias)`` from the gradients ``dga, dba`` of :func:`gates`' outputs, in the
    inputs' dtypes (the parameters' sums over tokens in float64; None where a parameter is not used)."""
    if not (opts.use_gate_in_kernel or opts.use_beta_sigmoid_in_kernel):
        return dga.to(g.dtype), dba.to(beta.dtype), None, None
    g, beta, dga, dba = g.contiguous(), beta.contiguous(), dga.contiguous(), dba.contiguous()
    dg = torch.empty(g.shape, device=g.device, dtype=torch.float32)
    db = torch.empty(beta.shape, device=beta.device, dtype=beta.dtype)
    da = torch.empty(g.shape if opts.use_gate_in_kernel else (0,), device=g.device, dtype=torch.float32)
    if g.numel():
        with _on(g.device):
            _gates_bwd[(triton.cdiv(g.numel(), _BLOCK),)](g, beta, *_params(A_log, dt_bias, dg), dga, dba, dg, db,
                                                          da, **_gate_args(g, dt_bias, opts))
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        dA_log = da.view(-1, g.shape[-1]).sum(0, dtype=torch.float64).to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = dg.view(-1, g.shape[-1]).sum(0, dtype=torch.float64).to(dt_bias.dtype)
    return dg.to(g.dtype), db, dA_log, ddt_bias
