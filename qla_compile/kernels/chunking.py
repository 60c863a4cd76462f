"""What the kernels and their host code share, with no TileLang: the chunk length and where the context-parallel
plan cuts sequences into pieces (``context_parallel`` has the kernels that run the pieces).

The kernel modules take :data:`CHUNK` from here, so this module is among the kernel sources that the prebuilt
binaries' sources hash covers (``_prebuilt.SOURCES``).
"""

import math

CHUNK = 64  # tokens per chunk
MIN_PIECE_CHUNKS = 4  # the shortest context-parallel piece of a forward alone, in chunks
MIN_BACKWARD_PIECE_CHUNKS = 8  # the shortest of a plan that a backward reuses
MIN_SUB_WALK_CHUNKS = 16  # the shortest sub-walk of an exact transition (``context_parallel``)
MAX_HEADS = 80  # no plan of a forward alone splits more v-heads (Be * H_v, :func:`piece_chunks`)
MAX_HEADS_BACKWARD = 60  # nor one that a backward reuses
# (bound on Be * H_v, fewest chunks of the longest sequence) under which a forward alone splits: the first three
# into pieces of the formula's length, the last into quarters of the longest sequence
_FORWARD_SPLITS = ((16, 32), (32, 64), (56, 128), (MAX_HEADS, 448))
# the same for a forward whose backward follows; the longest sequence needs two pieces' worth of chunks besides
_BACKWARD_SPLITS = ((24, 0), (MAX_HEADS_BACKWARD, 64))


def piece_chunks(lens, h_v: int, n_sm: int, backward: bool = False):
    """Piece length in chunks when CP pays off for these sequence lengths, else None; ``backward``: for a
    forward whose plan its backward reuses (the rule of the pair), else for a forward alone.

    With n_c chunks per sequence, Be = sum(n_c) / max(n_c) the effective number of sequences and
    x = H_v sum(n_c) / SMs, a forward alone cuts pieces of L = 2^round(log2(2.48 x^0.72)) chunks, at least 4
    (refitted on an H100 to the forward of 2026-12-07: 4 chunks at 8 v-heads over 32, 64 from x = 62 on,
    ``bench/results/2026-12-07-fwd-cp-rule-h100.md``), and splits when Be * H_v <= 16 with a sequence of at
    least 32 chunks, Be * H_v <= 32 with one of at least 64, or Be * H_v <= 56 with one of at least 128
    (``bench/results/2026-12-04-fwd-cp-rule.md``); and, into pieces of about a quarter of the longest sequence,
    when Be * H_v <= :data:`MAX_HEADS` with one of at least 448 chunks (1.10-1.12x at 64 v-heads on the H200
    with the gate-free transitions, ``bench/results/2026-12-05-fwd-per-head-inverse.md``). With its backward,
    L = 2^round(log2(4.5 sqrt(x))), at least 8 chunks (the shape of FlashQLA's rule, balancing the pieces' walk
    against the warm-up and scan), when the longest sequence has at least 2 L chunks and Be * H_v <= 24, or
    Be * H_v <= :data:`MAX_HEADS_BACKWARD` with at least 64 (fitted to forward + backward times of FlashQLA's
    32-row backward set, ``bench/NOTES-bwd.md``, sessions 6 and 7).
    Beyond these bounds the transitions of non-decaying heads cost more than the split saves.
    """
    n_c = [-(-n // CHUNK) for n in lens]
    total, longest = sum(n_c), max(n_c, default=0)
    if longest == 0:
        return None
    be_h = total / longest * h_v
    x = h_v * total / n_sm
    if backward:
        chunks = max(MIN_BACKWARD_PIECE_CHUNKS, 2 ** round(math.log2(4.5 * math.sqrt(x))))
        on = longest >= 2 * chunks and any(be_h <= b and longest >= n for b, n in _BACKWARD_SPLITS)
        return chunks if on else None
    chunks = max(MIN_PIECE_CHUNKS, 2 ** round(math.log2(2.48 * x ** 0.72)))
    if any(be_h <= b and longest >= n for b, n in _FORWARD_SPLITS[:-1]):
        return chunks
    b, n = _FORWARD_SPLITS[-1]
    return 2 ** round(math.log2(longest / 4)) if be_h <= b and longest >= n else None


def sub_walks(chunks: int) -> int:
    """The most sub-walks of an exact transition over a piece of ``chunks`` chunks in a forward alone: none shorter
    than :data:`MIN_SUB_WALK_CHUNKS`. How many of them run (``context_parallel._sub_walks``) is decided on the device,
    where the number of exact walks is known: as many as keep them within one CTA per SM. Sub-walks of 8 chunks
    were slower than none (H100, pieces of 16 at 1x8192: 4/16 0.131 against 0.128 ms, 2/8 0.097 against 0.094;
    ``bench/results/2026-12-07-fwd-cp-work-list-h100.md``)."""
    return max(1, chunks // MIN_SUB_WALK_CHUNKS)


def may_split(n_tok: int, h_v: int) -> bool:
    """Whether :func:`piece_chunks` could split some sequences of ``n_tok`` tokens in all for a forward alone, from
    shapes alone (as Be >= 1, Be * H_v >= H_v): a forward alone for which it cannot need not read its lengths."""
    return any(h_v <= b and -(-n_tok // CHUNK) >= n for b, n in _FORWARD_SPLITS)


def pieces(lens, chunk_len: int):
    """Host tables of the pieces (each sequence cut every ``chunk_len`` chunks).

    Returns int32 ``cu`` (token bounds of the pieces, ``[P+1]``), ``chunk_offsets`` (first chunk slot
    of each piece in the unsplit numbering, ``[P+1]``), ``seq_pieces`` (first piece of each sequence,
    ``[N+1]``) and ``last`` (whether each piece ends its sequence, ``[P]``), as Python lists.
    """
    cu, offs, seq_pieces, last = [0], [0], [0], []
    tok, slot = 0, 0
    step = chunk_len * CHUNK
    for n in lens:
        starts = list(range(0, n, step)) or [0]
        for j, s in enumerate(starts):
            end = min(s + step, n)
            cu.append(tok + end)
            offs.append(slot + -(-end // CHUNK))
            last.append(j == len(starts) - 1)
        tok, slot = tok + n, slot + -(-n // CHUNK)
        seq_pieces.append(len(last))
    return cu, offs, seq_pieces, last
