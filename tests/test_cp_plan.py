"""Host-side planning of the context-parallel forward (``qla_compile.kernels.chunking``), on the CPU: host code
only, so TileLang need not be installed."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def cp():
    from qla_compile.kernels import chunking

    return chunking


@pytest.mark.parametrize("lens,h_v,backward,expect_cp", [
    ([32768], 8, False, True),  # one sequence, few heads: most SMs idle
    ([8192], 16, False, True),
    ([8192], 64, False, False),  # 64 (sequence, v-head) pairs of 128 chunks: the split costs more than it saves
    ([8192] * 4, 16, False, False),  # Be * H = 64
    ([28672, 4096], 32, False, True),  # Be * H = 36.6, long
    ([8192] * 4, 8, False, True),  # Be * H = 32, each sequence 4x the work per SM
    ([2890, 5291, 11998, 12589], 32, False, False),  # Be * H = 83
    ([2048], 8, False, True),  # 32 chunks, Be * H = 8: pieces of 4 (H100: 0.045 vs 0.054 at 8, 0.075 unsplit)
    ([2048], 32, False, False),  # Be * H = 32 at 32 chunks: no gain
    ([4096], 32, False, True),  # Be * H = 32 at 64 chunks (H200: 0.129 vs 0.151 ms)
    ([1024], 2, False, False),  # 16 chunks: too short to pay for the extra launches
    # with the backward reusing the plan, splitting pays for shorter and more sequences
    ([32768], 8, True, True),
    ([8192] * 4, 16, True, False),  # Be * H = 64
    ([7296, 640, 256], 32, True, True),  # Be * H = 36.4, 114 chunks
    ([4600, 1800, 1792], 32, True, True),  # Be * H = 57.8, 72 chunks
    ([2890, 5291, 11998, 12589], 32, True, False),  # Be * H = 83
    ([1980] + [888] * 7, 4, True, True),  # Be * H = 16.9, 31 chunks: pieces of 8
    ([1980] + [888] * 7, 8, True, False),  # Be * H = 33.8, too short
    ([960], 2, True, False),  # fewer than two pieces' worth of chunks
])
def test_piece_chunks_rule(cp, lens, h_v, backward, expect_cp):
    """Whether the rule splits, and its piece length against its formula (within a factor sqrt 2): with a
    backward, 4.5 sqrt(x) and at least 8 chunks; a forward alone, 2.48 x^0.72 and at least 4."""
    chunks = cp.piece_chunks(lens, h_v, n_sm=132, backward=backward)
    assert (chunks is not None) == expect_cp
    if chunks is not None:
        x = h_v * sum(math.ceil(n / 64) for n in lens) / 132
        floor, target = (8, 4.5 * math.sqrt(x)) if backward else (4, 2.48 * x ** 0.72)
        assert chunks >= floor and chunks & (chunks - 1) == 0  # a power of two, at least the floor
        assert max(floor, target / math.sqrt(2)) <= chunks <= max(floor, target * math.sqrt(2))


@pytest.mark.parametrize("lens,h_v,expect", [
    ([2048], 8, 4), ([2048], 16, 8),  # H100 ms at 4 / 8 / 16: 0.045 / 0.053 / 0.078; 0.067 / 0.061 / 0.083
    ([8192], 8, 8), ([8192], 16, 16), ([8192], 32, 32),  # 8 / 16: 0.091 / 0.095; 16 / 32: 0.127 / 0.158
    ([32768], 8, 32), ([32768], 16, 64), ([28672, 4096], 16, 64),  # 16/16 28672+4096 at 32 / 64: 0.417 / 0.408
    ([32768], 32, 64), ([28672, 4096], 32, 64),
])
def test_forward_piece_length_is_the_swept_best(cp, lens, h_v, expect):
    """A forward alone cuts the piece length that was fastest on the H100 (``bench/cp_rule_sweep.py``,
    ``bench/results/2026-12-07-fwd-cp-rule-h100.md``; the ms in the comments are that run's)."""
    assert cp.piece_chunks(lens, h_v, n_sm=132) == expect


@pytest.mark.parametrize("chunks,expect", [(8, 1), (16, 1), (31, 1), (32, 2), (64, 4), (128, 8)])
def test_sub_walks_no_shorter_than_16_chunks(cp, chunks, expect):
    """The most sub-walks an exact transition over a piece may take (the device picks how many run, by the number
    of exact walks): none shorter than 16 chunks, where the H100 sweep found 8 slower than none."""
    assert cp.sub_walks(chunks) == expect


@pytest.mark.parametrize("lens,h_v,backward,expect", [
    ([32768], 64, False, 128),  # H200: 1.133 ms against 1.27 unsplit, 1.193 at the formula's 64
    ([28672, 4096], 64, False, 128),  # Be * H = 73: 1.160 against 1.28, 1.186 at 64
    ([32768], 64, True, None),  # a backward reuses the plan: not beyond 60 v-heads
    ([32768] * 2, 64, False, None),  # Be * H = 128
    ([16384], 64, False, None),  # shorter than 448 chunks: not measured to pay
])
def test_many_heads_split_into_quarters(cp, lens, h_v, backward, expect):
    """Above Be * H_v = 56 a forward alone splits only a sequence of at least 448 chunks, into about four pieces."""
    assert cp.piece_chunks(lens, h_v, n_sm=132, backward=backward) == expect


def test_may_split_from_shapes_bounds_the_rule(cp):
    """``may_split`` (shapes only) is True wherever the forward-alone rule splits, over random batches and head
    counts, and False for calls too short or too wide to split, so those never read their lengths."""
    gen = torch.Generator().manual_seed(0)
    split = 0
    for _ in range(3000):
        n_seq = int(torch.randint(1, 9, (), generator=gen))
        lens = torch.randint(0, 40000, (n_seq,), generator=gen).tolist()
        h_v = int(torch.randint(1, 97, (), generator=gen))
        if cp.piece_chunks(lens, h_v, 132) is not None:
            split += 1
            assert cp.may_split(sum(lens), h_v), (lens, h_v)
    assert split > 100
    assert not cp.may_split(28000, 64) and cp.may_split(32768, 64) and not cp.may_split(1 << 20, 81)
    assert not cp.may_split(1900, 4) and cp.may_split(2048, 4) and not cp.may_split(4000, 32)


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


def test_piece_tables(monkeypatch):
    from qla_compile.kernels import chunking
    from qla_compile.kernels.forward import _piece_tables

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch has no CUDA
    lens, L = [1000, 130, 0, 64 * 20 + 5, 512], 8
    pieces = _piece_tables(lens, L, torch.device("cpu"))
    cu, offs, seq_pieces, last = chunking.pieces(lens, L)
    assert pieces.cu.tolist() == cu and pieces.offsets.tolist() == offs and pieces.seq_pieces.tolist() == seq_pieces
    chunks = [b - a for a, b in zip(offs, offs[1:])]
    # a permutation, by decreasing chunk count, ties in piece order
    assert pieces.order.tolist() == sorted(range(len(last)), key=lambda p: (-chunks[p], p))
    # a sequence's final state comes from its last piece, its dh0 from its first (a 0-token sequence: one piece)
    seq_of = [n for n in range(len(lens)) for _ in range(seq_pieces[n], seq_pieces[n + 1])]
    assert pieces.ht_row.tolist() == [seq_of[p] if last[p] else -1 for p in range(len(last))]
    assert pieces.dh0_row.tolist() == [seq_of[p] if p in seq_pieces[:-1] else -1 for p in range(len(last))]
    assert sorted(r for r in pieces.ht_row.tolist() if r >= 0) == list(range(len(lens)))
    assert sorted(r for r in pieces.dh0_row.tolist() if r >= 0) == list(range(len(lens)))
    assert pieces.final_fwd.tolist() == [int(x) for x in last]
    # the backward forms M for every piece but a sequence's only one
    assert pieces.final_bwd.tolist() == [int(p in seq_pieces[:-1] and last[p]) for p in range(len(last))]
    # the backward's transition pass skips each sequence's first piece
    assert pieces.first.tolist() == [int(p in seq_pieces[:-1]) for p in range(len(last))]


def test_captured_tables_outlive_the_cache(monkeypatch):
    """Piece tables a CUDA graph captured stay alive after the cache is cleared: the graph replays from them."""
    from qla_compile.kernels import forward

    capturing = [False]
    monkeypatch.setattr(forward, "_capturing", lambda device: capturing[0])
    monkeypatch.setattr(forward, "_PIECE_TABLES", {})
    monkeypatch.setattr(forward, "_CAPTURED", {})
    cpu = torch.device("cpu")
    kept = forward._piece_tables([4000, 300], 8, cpu)
    capturing[0] = True
    assert forward._piece_tables([4000, 300], 8, cpu) is kept
    assert forward._piece_tables([5000], 8, cpu) is None  # not built yet: the captured call runs unsplit
    capturing[0] = False
    for n in range(forward._CACHE_SIZE):  # fills the cache: it is cleared once
        forward._piece_tables([600 + n], 8, cpu)
    assert all(v is not kept for v in forward._PIECE_TABLES.values())
    assert list(forward._CAPTURED.values()) == [kept]


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_context_parallel_argument_is_checked(bad):
    from qla_compile.kernels.forward import _check_context_parallel

    with pytest.raises(ValueError, match="context_parallel"):
        _check_context_parallel(bad)
    for good in (None, False, 1, 16):
        _check_context_parallel(good)


@pytest.mark.parametrize("lens,walk", [
    ([512] * 64, True),  # uniform batches walk (1.01-1.08x on chip, H100)
    ([8192] * 4, True),
    ([3000, 600, 512], True),
    ([8192] + [128] * 60, False),  # mostly one- and two-chunk sequences: a CTA per pair
    ([4096] + [64] * 400, False),
    ([1024, 0, 1024], False),
    ([511] * 8, False),
    (None, False),  # lengths not known on the host: no sync to learn them
])
def test_on_chip_launch_walks_where_no_sequence_is_short(lens, walk):
    from qla_compile.kernels.forward import _walks

    assert _walks(lens) is walk


def test_host_lengths_cached_per_tensor_and_version(monkeypatch):
    """Lengths are read once per cu_seqlens tensor and again after an in-place change; an inference tensor (no
    version counter) is read on every call."""
    from qla_compile.kernels import forward

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert forward._host_lengths(cu, 1, 12) == [5, 7] and forward._host_lengths(cu, 1, 12) == [5, 7]
    assert len(reads) == 1
    cu[2] = 20
    assert forward._host_lengths(cu, 1, 20) == [5, 15] and len(reads) == 2
    assert forward._host_lengths(cu.clone(), 1, 20, read=False) is None
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 9], dtype=torch.int32)
        assert forward._host_lengths(frozen, 1, 9) == [3, 6] and forward._host_lengths(frozen, 1, 9) == [3, 6]
    assert len(reads) == 4 and forward._host_lengths(frozen, 1, 9, read=False) is None


def test_walk_starts_list_schedule():
    from qla_compile.kernels.backward import _walk_starts

    assert _walk_starts([5, 3, 9], 4, 12) == [0, 0, 0]  # one wave
    # 4 SMs, 2 CTAs per walk, longest first: walks 1 and 3 start at once, walk 0 when walk 3's CTAs free their
    # SMs (2 chunks + 1 step), walk 2 when walk 0's do
    assert _walk_starts([2, 6, 1, 3], 2, 4) == [4, 0, 7, 0]


@pytest.mark.parametrize("n_c,ctas,n_sm", [([3, 1, 2], 1, 8), ([7, 0, 4, 4, 9], 16, 32), ([1] * 40, 4, 132)])
def test_publish_order(n_c, ctas, n_sm):
    from qla_compile.kernels.backward import _publish_order, _walk_starts

    order = _publish_order(n_c, ctas, n_sm).tolist()
    assert sorted(order) == list(range(sum(n_c)))
    start, first = _walk_starts(n_c, ctas, n_sm), [sum(n_c[:w]) for w in range(len(n_c))]
    walk_of = [w for w in range(len(n_c)) for _ in range(n_c[w])]
    published = [start[walk_of[s]] + first[walk_of[s]] + n_c[walk_of[s]] - s for s in order]
    assert published == sorted(published)  # by when the reverse recurrence publishes them
    for w in range(len(n_c)):  # each walk's chunks last to first
        mine = [s for s in order if walk_of[s] == w]
        assert mine == sorted(mine, reverse=True)
    assert _publish_order([3, 1, 2], 1, 8).tolist() == [2, 3, 5, 1, 4, 0]  # ties in slot order


def test_chunk_table():
    from qla_compile.kernels.backward import _chunk_table

    lens = [130, 0, 64, 1]  # chunks of 64, 64, 2 | - | 64 | 1
    rows = _chunk_table(lens, torch.tensor([4, 0, 2, 3, 1])).tolist()
    assert rows == [[4, 194, 1, 0], [0, 0, 64, 0], [2, 128, 2, 0], [3, 130, 64, 0], [1, 64, 64, 0]]


def test_cache_bound_holds_every_chosen_plan(cp, monkeypatch):
    """``cp_cache_numel`` (from shapes alone: the size of the forward's context-parallel cache output) is at least
    what the plan ``_cp_plan`` chooses for any sequence lengths needs where a backward follows (a forward alone
    keeps no cache), also for sequences long enough that the plan takes a longer piece length to stay within it;
    either plan has at most ``_CP_MAX_EXTRA_PIECE_HEADS`` extra (piece, v-head) pairs."""
    import random

    from qla_compile.kernels import forward as kernels

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels, "_sm_count", lambda *_: 132)
    rng = random.Random(0)
    capped = 0
    for _ in range(400):
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 600_000)]) for _ in range(rng.randint(1, 10))]
        h_v = rng.choice([1, 2, 4, 8, 16, 24, 32, 48, 60])
        for backward in (False, True):
            cu = torch.tensor([0] + lens).cumsum(0)
            plan = kernels._cp_plan(None, cu, 1, int(cu[-1]), h_v, torch.device("cpu"), backward)
            if plan is None:
                continue
            n_p = plan.order.numel()
            assert (n_p - len(lens)) * h_v <= kernels._CP_MAX_EXTRA_PIECE_HEADS, (lens, h_v, backward)
            need = n_p * h_v * (128 * 128 * 2 + 1)
            assert not backward or need <= kernels.cp_cache_numel(sum(lens), len(lens), h_v, 128, 128), (lens, h_v)
            capped += plan.chunks > cp.piece_chunks(lens, h_v, 132, backward)
    assert capped  # some lengths were long enough for the cap to apply
