"""Every bad input gets a clear TypeError/ValueError that names the argument."""
import pytest
import torch
from gdn_inputs import make_inputs

from qla_compile import chunk_gated_delta_rule


def _kw(**spec):
    return make_inputs(**{"B": 1, "T": 12, "H": 2, "HV": 4, "K": 8, "V": 8, **spec}, seed=0)


def _expect(error, match, **overrides):
    kw = _kw()
    kw.update(overrides)
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(**kw)


def test_k_shape_mismatch():
    _expect(ValueError, r"`k` must have q's shape", k=torch.randn(1, 12, 2, 16))


def test_v_length_mismatch():
    _expect(ValueError, r"`v` must have shape \[B, T, HV, V\]", v=torch.randn(1, 11, 4, 8))


def test_heads_not_a_multiple():
    _expect(ValueError, r"HV=3 heads, which must be a multiple of q/k's H=2",
            v=torch.randn(1, 12, 3, 8), g=torch.randn(1, 12, 3), beta=torch.rand(1, 12, 3))


@pytest.mark.parametrize("name", ["g", "beta"])
def test_gate_and_beta_shape(name):
    _expect(ValueError, rf"`{name}` must have shape \[B, T, HV\] = \[1, 12, 4\]", **{name: torch.rand(1, 12, 2)})


def test_wrong_rank():
    _expect(ValueError, r"`q` must have shape \[B, T, H, K\]", q=torch.randn(12, 2, 8))


def test_not_a_tensor():
    _expect(TypeError, r"`beta` must be a torch.Tensor", beta=[0.5] * 12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype(dtype):
    _expect(TypeError, r"`v` must be float32, float16 or bfloat16", v=torch.ones(1, 12, 4, 8, dtype=dtype))


def test_mixed_qkv_dtypes():
    _expect(TypeError, r"`q`, `k`, `v` must share one dtype", v=torch.randn(1, 12, 4, 8, dtype=torch.bfloat16))


def test_cu_seqlens_with_batch_above_one():
    kw = _kw(B=2)
    with pytest.raises(ValueError, match=r"batch size must be 1.*got B=2"):
        chunk_gated_delta_rule(**kw, cu_seqlens=torch.tensor([0, 12]))


@pytest.mark.parametrize(
    "bounds, match",
    [([1, 6, 12], "must start at 0"), ([0, 7, 5, 12], "must be non-decreasing"), ([0, 6, 11], r"must end at T=12")],
)
def test_cu_seqlens_values(bounds, match):
    _expect(ValueError, rf"`cu_seqlens` {match}", cu_seqlens=torch.tensor(bounds))


def test_cu_seqlens_cpu_copy_is_checked():
    _expect(ValueError, r"`cu_seqlens` must end at T=12",
            cu_seqlens=torch.tensor([0, 12]), cu_seqlens_cpu=torch.tensor([0, 11]))


def test_cu_seqlens_dtype():
    _expect(TypeError, r"`cu_seqlens` must be int32 or int64", cu_seqlens=torch.tensor([0.0, 12.0]))


def test_cu_seqlens_rank():
    _expect(ValueError, r"`cu_seqlens` must be a 1-D tensor", cu_seqlens=torch.tensor([[0, 12]]))


def test_initial_state_shape():
    _expect(ValueError, r"`initial_state` must have shape \[N, HV, K, V\] = \[1, 4, 8, 8\], got \[1, 4, 8, 4\]",
            initial_state=torch.zeros(1, 4, 8, 4))


def test_initial_state_count_for_varlen():
    _expect(ValueError, r"`initial_state` must have shape \[N, HV, K, V\] = \[2, 4, 8, 8\]",
            cu_seqlens=torch.tensor([0, 5, 12]), initial_state=torch.zeros(1, 4, 8, 8))


def test_initial_state_v_first_layout():
    _expect(ValueError, r"\[N, HV, V, K\] = \[1, 4, 4, 8\]",
            v=torch.randn(1, 12, 4, 4), state_v_first=True, initial_state=torch.zeros(1, 4, 8, 4))


def test_gate_in_kernel_needs_A_log():
    _expect(ValueError, r"`A_log` of shape \[HV\] is required", use_gate_in_kernel=True)


def test_A_log_shape():
    _expect(ValueError, r"`A_log` must have shape \[HV\] = \[4\]", use_gate_in_kernel=True, A_log=torch.zeros(2))


def test_A_log_without_flag():
    _expect(ValueError, r"only used with `use_gate_in_kernel=True`", A_log=torch.zeros(4))


def test_neg_eigval_needs_beta_sigmoid():
    _expect(ValueError, r"`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`", allow_neg_eigval=True)


@pytest.mark.parametrize("scale", [float("nan"), "0.5", True])
def test_bad_scale(scale):
    _expect(TypeError, r"`scale` must be a finite float", scale=scale)


def test_bad_chunk_size():
    _expect(ValueError, r"`chunk_size` must be 16, 32 or 64", chunk_size=128)


def test_devices_must_match():
    _expect(ValueError, r"all tensors must be on one device.*g on meta", g=torch.empty(1, 12, 4, device="meta"))
