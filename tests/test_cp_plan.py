"""Host-side planning of the context-parallel forward (``qla_compile.kernels.cp_fwd``), on the CPU."""
import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")


@pytest.fixture(scope="module")
def cp():
    from qla_compile.kernels import cp_fwd

    return cp_fwd


@pytest.mark.parametrize("lens,h_v,expect_cp", [
    ([32768], 8, True),  # one sequence, few heads: most SMs idle
    ([8192], 16, True),
    ([32768], 64, False),  # 64 CTAs per sequence already
    ([8192] * 4, 16, False),  # Be * H = 64
    ([28672, 4096], 32, True),  # Be * H = 36.6, long
    ([8192] * 4, 8, False),  # Be * H = 32, short
    ([2048], 2, False),  # too short to pay for the extra launches
])
def test_piece_chunks_rule(cp, lens, h_v, expect_cp):
    chunks = cp.piece_chunks(lens, h_v, n_sm=132)
    assert (chunks is not None) == expect_cp
    if chunks is not None:
        assert chunks >= 8 and chunks & (chunks - 1) == 0  # a power of two, at least 8 chunks
        n_c = [math.ceil(n / 64) for n in lens]
        target = 3 * math.sqrt(h_v * sum(n_c) / 132)
        assert max(8, target / math.sqrt(2)) <= chunks <= max(8, target * math.sqrt(2))


def test_pieces_partition_every_sequence(cp):
    lens, L = [1000, 130, 0, 64 * 20 + 5, 512], 8
    cu, offs, seq_pieces, last = cp.pieces(lens, L)
    assert len(cu) == len(offs) == len(last) + 1 and len(seq_pieces) == len(lens) + 1
    tok = slot = 0
    for n, (p0, p1) in enumerate(zip(seq_pieces, seq_pieces[1:])):
        assert p1 > p0  # every sequence keeps at least one piece (an empty one for n = 0)
        assert cu[p0] == tok and cu[p1] == tok + lens[n]
        for p in range(p0, p1):
            size = cu[p + 1] - cu[p]
            assert offs[p] == slot + (cu[p] - tok) // 64  # pieces start on a chunk of their sequence
            assert last[p] == (p == p1 - 1)
            assert size == (min(L * 64, lens[n] - (cu[p] - tok)) if lens[n] else 0)
        tok += lens[n]
        slot += math.ceil(lens[n] / 64)
    assert offs[-1] == slot


def test_warmup_skip_matches_a_loop(cp):
    gen = torch.Generator().manual_seed(0)
    n_slots, h_v, L = 40, 5, 8
    gb = torch.zeros(n_slots, h_v, 2, 64)
    sums = -torch.rand(n_slots, h_v, generator=gen) * 6  # chunk gate sums in [-6, 0]
    sums[:, 0] = 0  # a head that never decays: always the exact transition
    sums[33:] = float("nan")  # unused slots hold garbage: never read
    gb[:, :, 0, 63] = sums
    # two sequences cut every 8 chunks: pieces of 8, 8, 6 and of 8, 3 chunks
    offs = torch.tensor([0, 8, 16, 22, 30, 33], dtype=torch.int32)
    forward_last = torch.tensor([False, False, True, False, True])
    for last in (forward_last, torch.zeros(5, dtype=torch.bool)):  # the backward forms every piece's M
        for contractive in (True, False):
            skip = cp.warmup_skip(gb, offs, last, L, torch.tensor(contractive))
            for p in range(5):
                n_chunks = int(offs[p + 1] - offs[p])
                for h in range(h_v):
                    if last[p]:
                        expect = 1 << 30
                    else:
                        total, expect = 0.0, -1
                        for n in range(1, n_chunks + 1):  # the last n chunks of the piece
                            total += sums[offs[p] + n_chunks - n, h].item()
                            if total < -10 and contractive:
                                expect = n_chunks - n
                                break
                    assert skip[p, h].item() == expect, (p, h, contractive)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_context_parallel_argument_is_checked(bad):
    from qla_compile.kernels import _check_context_parallel

    with pytest.raises(ValueError, match="context_parallel"):
        _check_context_parallel(bad)
    for good in (None, False, 1, 16):
        _check_context_parallel(good)
