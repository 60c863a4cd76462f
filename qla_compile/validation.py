"""Argument checks for ``chunk_gated_delta_rule``: clear errors that name the argument and the expected shape."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"`{name}` must have shape {layout}, got {_shape(t)}")
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"`{name}` must be float32, float16 or bfloat16, got {t.dtype}")


def check_inputs(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
) -> None:
    """Raise ``TypeError``/``ValueError`` for any argument FLA's op would reject or mis-handle.

    Checks only shapes, dtypes and devices (no device sync); ``check_cu_seqlens_values`` checks the values.
    """
    _tensor("q", q, 4, "[B, T, H, K]")
    _tensor("k", k, 4, "[B, T, H, K]")
    _tensor("v", v, 4, "[B, T, HV, V]")
    _tensor("g", g, 3, "[B, T, HV]")
    _tensor("beta", beta, 3, "[B, T, HV]")
    if k.shape != q.shape:
        raise ValueError(f"`k` must have q's shape [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"`v` must have shape [B, T, HV, V] with B, T = {B}, {T} (from q), got {_shape(v)}")
    if HV % H != 0:
        raise ValueError(f"`v` has HV={HV} heads, which must be a multiple of q/k's H={H} (GVA)")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"`{name}` must have shape [B, T, HV] = [{B}, {T}, {HV}], got {_shape(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"`q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and (
        not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        raise TypeError(f"`scale` must be a finite float or None, got {scale!r}")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError("`cu_seqlens` must be a 1-D tensor [N + 1] of sequence boundaries (N >= 1)")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"`cu_seqlens` must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1 (flatten the sequences), got B={B}")
        tensors["cu_seqlens"] = cu_seqlens
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None:
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        _tensor("initial_state", initial_state, 4, layout)
        if initial_state.shape != expected:
            raise ValueError(
                f"`initial_state` must have shape {layout} = [{', '.join(map(str, expected))}], "
                f"got {_shape(initial_state)}"
            )
        tensors["initial_state"] = initial_state
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` of shape [HV] is required when `use_gate_in_kernel=True`")
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is None:
                continue
            _tensor(name, t, 1, "[HV]")
            if t.shape[0] != HV:
                raise ValueError(f"`{name}` must have shape [HV] = [{HV}], got {_shape(t)}")
            tensors[name] = t
    elif A_log is not None or dt_bias is not None:
        raise ValueError("`A_log`/`dt_bias` are only used with `use_gate_in_kernel=True`; pass that flag too")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_cu_seqlens_values(cu_seqlens: Tensor, total: int) -> None:
    """Check ``cu_seqlens`` starts at 0, never decreases and ends at T. Reads the values (a device sync)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {bounds[0]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"`cu_seqlens` must be non-decreasing, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"`cu_seqlens` must end at T={total} (the number of tokens), got {bounds[-1]}")
