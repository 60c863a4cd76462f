"""The varlen tables kernel of the SM90 forward and backward: ``cu_seqlens`` as int32, the chunk offsets of the
packed sequences, each chunk slot's span and the recurrent kernels' launch order (longest sequence first), in one
launch."""

import tilelang.language as T

from ._build import compiled
from .chunking import CHUNK

_TABLE_BLOCK = 1024  # sequences per step of seq_tables' scan
_LOG2_BLOCK = 10
assert 1 << _LOG2_BLOCK == _TABLE_BLOCK


@compiled
def seq_tables(*, cu_dtype: str):
    """int32 ``cu_seqlens``, ``chunk_offsets`` (exclusive cumsum of ceil(len / 64)), ``spans`` and the launch order of
    the state kernels in one launch.

    Call as ``kernel(cu_in, cu, chunk_offsets, spans, order)`` with ``cu_in`` the caller's int32 or int64 bounds.
    ``spans[slot] = (first token, tokens)`` of chunk slot ``slot`` (``[n_slots, 2]``; ``(0, 0)`` for the slots past
    the last chunk), so that a per-chunk kernel reads where its chunk lies in one load.
    One CTA scans the sequences 1024 at a time (a handful of tiny torch ops would cost a launch each).
    ``order`` ``[N]`` lists the sequences by decreasing chunk count (ties in index order), so that the
    longest walks of the recurrent kernels start first; with more than 1024 sequences it is the identity.
    """
    n_seq1 = T.dynamic("n_seq1")
    n_slots = T.dynamic("n_slots")
    B = _TABLE_BLOCK

    @T.prim_func
    def kernel(
        cu_in: T.Tensor((n_seq1,), cu_dtype),
        cu: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        spans: T.Tensor((n_slots, 2), "int32"),
        order: T.Tensor((n_seq1 - 1,), "int32"),
    ):
        with T.Kernel(1, threads=B):
            n_s = T.alloc_shared((B,), "int32")
            c_s = T.alloc_shared((B,), "int32")
            tx = T.get_thread_binding()
            base = T.alloc_var("int32", init=0)
            lo = T.alloc_var("int32", init=0)
            total = T.alloc_var("int32", init=0)  # this block's chunks
            for blk in T.serial(T.ceildiv(n_seq1, B)):
                i = blk * B + tx
                length = T.if_then_else((i >= 1) & (i < n_seq1), T.cast(cu_in[i] - cu_in[i - 1], "int32"), 0)
                n_s[tx] = T.ceildiv(length, CHUNK)
                T.cumsum(n_s)
                if i < n_seq1:
                    cu[i] = T.cast(cu_in[i], "int32")
                    chunk_offsets[i] = base + n_s[tx]
                # this block's chunks: n_s[t] counts those of sequences blk B - 1 .. blk B + t - 1, so chunk c is
                # in sequence blk B + t - 1 for the first t with n_s[t] > c (by bisection)
                total = n_s[B - 1]
                for step in T.serial(T.ceildiv(total, B)):
                    c = step * B + tx
                    if c < total:
                        lo = 0
                        for b in T.serial(_LOG2_BLOCK):
                            probe = lo + (B >> (b + 1)) - 1
                            if n_s[probe] <= c:
                                lo = probe + 1
                        first = T.if_then_else(lo > 0, n_s[T.max(lo - 1, 0)], 0)
                        seq = blk * B + lo - 1
                        token = T.cast(cu_in[seq], "int32") + (c - first) * CHUNK
                        spans[base + c, 0] = token
                        spans[base + c, 1] = T.min(T.cast(cu_in[seq + 1], "int32") - token, CHUNK)
                base = base + total
                T.sync_threads()  # n_s is read before the next block's scan writes it
            for step in T.serial(T.ceildiv(n_slots - base, B)):
                if base + step * B + tx < n_slots:
                    spans[base + step * B + tx, 0] = 0
                    spans[base + step * B + tx, 1] = 0
            n_seq = n_seq1 - 1
            if n_seq <= B:
                # rank of sequence tx: the sequences with more chunks, and those before it with as many
                own = T.if_then_else(tx < n_seq, T.ceildiv(T.cast(cu_in[tx + 1] - cu_in[tx], "int32"), CHUNK), 0)
                c_s[tx] = own
                T.sync_threads()
                if tx < n_seq:
                    rank = T.alloc_var("int32", init=0)
                    for j in T.serial(n_seq):
                        rank = rank + T.if_then_else((c_s[j] > own) | ((c_s[j] == own) & (j < tx)), 1, 0)
                    order[rank] = tx
            else:
                for blk in T.serial(T.ceildiv(n_seq, B)):
                    if blk * B + tx < n_seq:
                        order[blk * B + tx] = blk * B + tx

    return kernel


def variants():
    """``(kernel name, params)`` of both table variants (int32 and int64 ``cu_seqlens``)."""
    return [("seq_tables", dict(cu_dtype=dtype)) for dtype in ("int32", "int64")]
