"""The dense-input tables of the SM90 kernels (``forward._dense_tables``: cu_seqlens, chunk offsets, launch order and
the chunk slots' spans), built by torch on the CPU, against a loop over the sequences' chunks."""
import pytest
import torch


@pytest.mark.parametrize("batch,seqlen", [(1, 64), (3, 100), (4, 4096), (2, 1), (5, 130)])
def test_dense_tables_match_a_loop(batch, seqlen):
    from qla_compile.kernels import forward

    cu, offsets, order, spans = forward._dense_tables(batch, seqlen, "cpu")
    per_seq = -(-seqlen // 64)
    assert cu.tolist() == [n * seqlen for n in range(batch + 1)]
    assert offsets.tolist() == [n * per_seq for n in range(batch + 1)]
    assert order.tolist() == list(range(batch))
    expect = [(n * seqlen + 64 * j, min(64, seqlen - 64 * j)) for n in range(batch) for j in range(per_seq)]
    n_slots = batch * seqlen // 64 + batch  # forward._n_slots: the bound the per-chunk tables are sized by
    assert spans.shape == (n_slots, 2) and spans.dtype == torch.int32
    assert [tuple(x) for x in spans.tolist()] == expect + [(0, 0)] * (n_slots - len(expect))
