"""The varlen tables kernel of the SM90 forward and backward: ``cu_seqlens`` as int32, the chunk offsets of the
packed sequences and the recurrent kernels' launch order (longest sequence first), in one launch."""

import tilelang.language as T

from ._build import compiled
from .chunking import CHUNK

_TABLE_BLOCK = 1024  # sequences per step of seq_tables' scan


@compiled
def seq_tables(*, cu_dtype: str):
    """int32 ``cu_seqlens``, ``chunk_offsets`` (exclusive cumsum of ceil(len / 64)) and the launch order of the
    state kernels in one launch.

    Call as ``kernel(cu_in, cu, chunk_offsets, order)`` with ``cu_in`` the caller's int32 or int64 bounds.
    One CTA scans the sequences 1024 at a time (a handful of tiny torch ops would cost a launch each).
    ``order`` ``[N]`` lists the sequences by decreasing chunk count (ties in index order), so that the
    longest walks of the recurrent kernels start first; with more than 1024 sequences it is the identity.
    """
    n_seq1 = T.dynamic("n_seq1")
    B = _TABLE_BLOCK

    @T.prim_func
    def kernel(
        cu_in: T.Tensor((n_seq1,), cu_dtype),
        cu: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        order: T.Tensor((n_seq1 - 1,), "int32"),
    ):
        with T.Kernel(1, threads=B):
            n_s = T.alloc_shared((B,), "int32")
            c_s = T.alloc_shared((B,), "int32")
            tx = T.get_thread_binding()
            base = T.alloc_var("int32", init=0)
            for blk in T.serial(T.ceildiv(n_seq1, B)):
                i = blk * B + tx
                length = T.if_then_else((i >= 1) & (i < n_seq1), T.cast(cu_in[i] - cu_in[i - 1], "int32"), 0)
                n_s[tx] = T.ceildiv(length, CHUNK)
                T.cumsum(n_s)
                if i < n_seq1:
                    cu[i] = T.cast(cu_in[i], "int32")
                    chunk_offsets[i] = base + n_s[tx]
                base = base + n_s[B - 1]
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
