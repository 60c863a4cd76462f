"""The L2 norm of q and k for eager Hopper calls, forward and backward, each one Triton pass in fp32.

``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim (``reference.l2norm``), read from a strided ``[B, T, H, D]``
view (the split of a fused qkv projection) and written contiguous in ``x``'s dtype, which is what the TileLang
kernels take; the backward reads ``x`` and the gradient of the normalised rows and recomputes the norm instead
of keeping it. In torch ops each is five to eight passes over fp32 copies. Traced calls do not come here: there
the norm is a graph op that Inductor fuses (``api.op_call(lift=True)``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import L2NORM_EPS

_ROWS = 32  # rows of D elements per program


@triton.jit
def _rows(n_rows, heads, stride_t, stride_h, ROWS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    return rows, rows < n_rows, (rows // heads) * stride_t + (rows % heads) * stride_h


@triton.jit
def _l2norm_fwd(x_ptr, y_ptr, n_rows, heads, stride_t, stride_h, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr):
    rows, live, src = _rows(n_rows, heads, stride_t, stride_h, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_bwd(x_ptr, dy_ptr, dx_ptr, n_rows, heads, stride_t, stride_h, eps, D: tl.constexpr,
                BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    rows, live, src = _rows(n_rows, heads, stride_t, stride_h, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < D)
    dense = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    dx = rstd[:, None] * (dy - y * tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + dense, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _strided_rows(x):
    """``(x, stride of a token, stride of a head)`` with x addressable as rows ``(token, head)`` of unit-stride
    elements (copied contiguous only where it is not)."""
    B, T, H, D = x.shape
    if x.stride(3) != 1 or (B > 1 and x.stride(0) != T * x.stride(1)):
        x = x.contiguous()
    return x, x.stride(1), x.stride(2)


def _launch(kernel, x, *tensors):
    x, stride_t, stride_h = _strided_rows(x)
    B, T, H, D = x.shape
    n_rows = B * T * H
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if n_rows:
        kernel[(triton.cdiv(n_rows, _ROWS),)](x, *tensors, out, n_rows, H, stride_t, stride_h, L2NORM_EPS, D=D,
                                               BLOCK_D=triton.next_power_of_2(D), ROWS=_ROWS, num_warps=4)
    return out


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """The L2-normalised rows of ``x`` ``[B, T, H, D]`` (computed in fp32), contiguous, in ``x``'s dtype."""
    return _launch(_l2norm_fwd, x)


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`l2norm` at ``x`` given ``dy`` (its output's gradient), contiguous, in ``x``'s
    dtype."""
    return _launch(_l2norm_bwd, x, dy.contiguous())
