"""Host code of the GDN chunked-prefill forward on SM90: checks, chunk and piece tables, the kernel launches.

Entry points, called by ``qla_compile.dispatch`` on SM90 CUDA tensors (and exported by ``qla_compile.kernels``):

* :func:`hopper_supported` -- whether these kernels handle the given tensors (:func:`unsupported`: why not).
* :func:`chunk_gdr_fwd_hopper` -- ``(o, final_state)``.
* :func:`chunk_gdr_fwd_hopper_aux` -- ``(o, final_state, tt, gb, chunk_offsets, cp_cache)``, also returning
  the gate-free inverse T~, the per-chunk gate cumsum and the context-parallel plan's products for a
  backward pass.

The forward is two kernels: ``kkt_inverse`` (gate cumsum and the gate-free inverse T~, all
chunks in parallel) and the warp-specialised chunk recurrence, a programmatic dependent launch of the first (its
launch and first loads overlap the first's last CTAs): ``split_state_recurrence.chunk_fwd_split`` (the state in
registers, split over two warpgroups) where every (sequence, v-head) pair fills a CTA of its own, else
``chunk_recurrence.chunk_fwd_ws`` with the V dimension split over two CTAs (:func:`_state_kernel`). A forward
alone that does not split, with at least 128 (sequence, v-head) pairs, is one kernel instead: the split-state
recurrence forms the gate tables and the inverse on chip (``chunk_fwd_split(inverse=True)``,
:func:`_onchip_inverse`). When few
long sequences would leave SMs idle, ``context_parallel`` cuts them into pieces that run in parallel
(gate-driven context parallelism: a warm-up or exact transition per piece, then a scan of the
pieces' initial states, then the output pass over the pieces, by the same choice of recurrence). The recurrent
kernels start the longest sequences (or pieces) first, so that unequal lengths do not leave a long walk to the end
of the launch.
One compile per (K, V, dtype, initial state or not, V split or not) serves every head count, length
and batch layout:
a dense ``[B, T]`` batch runs as one packed sequence with ``cu_seqlens = [0, T, 2T, ...]``.

CUDA graphs: dense inputs are capturable (no host sync; the chunk tables are built on the device).
Varlen inputs are capturable too, with no warm-up call, when ``cu_seqlens`` is already a CUDA tensor:
the number of chunk slots is bounded by ``T_total // 64 + N`` from shapes alone (a CPU ``cu_seqlens``
is copied to the device, which capture forbids). Context parallelism needs the sequence lengths on
the host: an uncaptured varlen call reads a CUDA ``cu_seqlens`` (one synchronisation, once per tensor: the
lengths are cached by identity and version) where a backward follows and H_v <= 60, or, for a forward alone,
where its shapes allow a split (``chunking.may_split``: H_v <= 80 and enough tokens), and builds the piece
tables; a captured call runs context-parallel only when an earlier uncaptured call with the same ``cu_seqlens``
tensor (or the same dense shape) left that plan in the cache (the graph then keeps it, whatever lengths are written
into that tensor later), and unsplit otherwise.
Known gaps: a log gate of -inf gives NaN (clamp g >= -88 before the call); the q/k L2 norm runs as
torch ops before the kernels.
"""

import contextlib
import functools
import logging
import weakref
from typing import NamedTuple

import torch

from ..reference import l2norm_fp32
from . import chunking
from ._build import Kernels
from .chunking import CHUNK

# the kernel modules' kernels, through ``_build.kernel``: prebuilt binaries load without importing TileLang
chunk_recurrence = Kernels("chunk_recurrence")
context_parallel = Kernels("context_parallel")
kkt_inverse = Kernels("kkt_inverse")
seq_tables = Kernels("seq_tables")
split_state_recurrence = Kernels("split_state_recurrence")

log = logging.getLogger(__name__)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_HEAD_DIMS = (128,)
# Below this many (sequence, v-head) pairs the V dimension is split in two to fill the 132 SMs.
_FULL_DV_MIN_CTAS = 88
# A plan cuts at most this many (piece, v-head) pairs beyond one piece per sequence: a longer piece length is
# taken where the chosen one would cut more (only sequences of about 200k tokens or more are affected), so
# that the forward's context-parallel cache has a size known from shapes (:func:`cp_cache_numel`).
_CP_MAX_EXTRA_PIECE_HEADS = 512
# (sequence, v-head) pairs from which a forward alone forms its inverse on chip (``_onchip_inverse``)
_ONCHIP_MIN_CTAS = 128
_WALK_MIN_TOKENS = 512  # ``_walks``


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, asked once (~4 us per query on the H200's host)."""
    return torch.cuda.get_device_capability(index)


def unsupported(q, k, v) -> str | None:
    """Why the SM90 kernels do not handle these q, k, v (device, arch, dtype, head dims, GVA), or None."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"tensors on {q.device.type}, not CUDA"
    capability = _capability(q.device.index)
    if capability != (9, 0):
        return f"an sm_{capability[0]}{capability[1]} GPU (the kernels are for SM90: H100/H200)"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (the kernels take bf16/fp16 q, k, v)"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        return "shapes other than q, k [B, T, H, K] and v [B, T, HV, V]"
    h_qk, dk, h_v, dv = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    if dk not in _HEAD_DIMS or dv not in _HEAD_DIMS:
        return f"head dims K = {dk}, V = {dv} (the kernels take K = V = 128)"
    if h_v % h_qk:
        return f"{h_v} v-heads for {h_qk} qk-heads (not a multiple)"
    return None


def hopper_supported(q, k, v, *args, **kwargs) -> bool:
    """True when the SM90 kernels handle these q, k, v (:func:`unsupported` has no reason)."""
    return unsupported(q, k, v) is None


# Host-side facts cached per live cu_seqlens tensor (checked by identity, version counter and a key), so that a
# captured call can reuse them and a model's other GDN layers skip their work: sequence lengths (the
# context-parallel plan's), the device tables of ``_tables``; and piece tables per plan.
_LENGTHS: dict = {}
_COPIES: dict = {}  # cu_seqlens -> its pinned host copy and the event of its landing (``_lengths_landed``)
_SEQ_TABLES: dict = {}
_ORDERS: dict = {}  # the on-chip launch order per set of lengths (``_onchip_tables``)
_PIECE_TABLES: dict = {}
_CACHE_SIZE = 64
# cached tables a CUDA graph captured, kept for good: the graph replays from their addresses after the caches above
# may have dropped them
_CAPTURED: dict = {}


def _capturing(device):
    """Whether work for ``device`` goes into a CUDA graph: the current CUDA stream is capturing (never for the CPU)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _held(cache, key, capturing):
    """``cache[key]``, kept in ``_CAPTURED`` as well while a CUDA graph is ``capturing``."""
    if capturing:
        _CAPTURED[(id(cache), key)] = cache[key]
    return cache[key]


def _recall(cache, t, key=None):
    """What ``cache`` holds for tensor ``t`` (by identity, version counter and ``key``), else None."""
    hit = cache.get(id(t))
    if hit is None or hit[0]() is not t or hit[1] != (t._version, key):  # no inference tensor is kept
        return None
    return hit[2]


def _cache_put(cache, key, value, size=_CACHE_SIZE):
    """``cache[key] = value`` for a cache of at most ``size`` entries (emptied first when full)."""
    if len(cache) >= size:
        cache.clear()
    cache[key] = value


def _remember(cache, t, value, key=None):
    """``value``, kept in ``cache`` for tensor ``t`` (:func:`_recall`) unless ``t`` is an inference tensor, which
    keeps no version counter to tell an in-place change by."""
    if not t.is_inference():
        _cache_put(cache, id(t), (weakref.ref(t), (t._version, key), value))
    return value


@functools.cache
def _say_lengths_read_per_call():
    log.warning("qla_compile: cu_seqlens was made under torch.inference_mode, so it keeps no version counter and its "
                "sequence lengths are read on every call (one synchronisation each) instead of once per tensor; "
                "make it under torch.no_grad() to have them read once")


def _host_lengths(cu_seqlens, batch, seqlen, read=True):
    """Sequence lengths as a Python list, or None when reading them would break CUDA-graph capture
    (a ``cu_seqlens`` seen before outside capture is answered from the cache) or, with ``read=False``,
    would synchronise at all: then a CUDA ``cu_seqlens`` is copied to the host without waiting, for a later
    call (a model's next GDN layer) to find landed (:func:`_lengths_landed`)."""
    if cu_seqlens is None:
        return [seqlen] * batch
    lens = _recall(_LENGTHS, cu_seqlens)
    if lens is not None:
        return lens
    if not read:
        return _lengths_landed(cu_seqlens)
    if _capturing(cu_seqlens.device):
        return None
    if cu_seqlens.is_cuda and cu_seqlens.is_inference():
        _say_lengths_read_per_call()
    return _remember(_LENGTHS, cu_seqlens, _lengths(cu_seqlens.tolist()))


def _lengths(bounds):
    """Sequence lengths from their cumulative bounds (a host list)."""
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _lengths_landed(cu_seqlens):
    """The lengths of a CUDA ``cu_seqlens`` from its copy to pinned host memory where an earlier call's has landed
    (its event done), else None, starting that copy on the current stream (never in a capture, nor for an
    inference tensor, whose in-place changes no version counter tells)."""
    if not cu_seqlens.is_cuda or _capturing(cu_seqlens.device):
        return None
    copy = _recall(_COPIES, cu_seqlens)
    if copy is None:
        if not cu_seqlens.is_inference():
            with torch.cuda.device(cu_seqlens.device):
                host = torch.empty(cu_seqlens.shape, dtype=cu_seqlens.dtype, pin_memory=True)
                host.copy_(cu_seqlens, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record()
            _remember(_COPIES, cu_seqlens, (host, landed))
        return None
    host, landed = copy
    if not landed.query():
        return None
    del _COPIES[id(cu_seqlens)]
    return _remember(_LENGTHS, cu_seqlens, _lengths(host.tolist()))


def _tables(cu_seqlens, batch, seqlen, device):
    """int32 cu_seqlens, chunk_offsets (exclusive cumsum of ceil(len / 64)), the recurrent kernels' launch order
    (longest sequence first) and the chunk slots' spans ``[_n_slots, 2]`` (first token, tokens; ``seq_tables``),
    built on the device once per ``cu_seqlens`` tensor outside CUDA-graph capture (a model's GDN layers share one:
    a launch fewer a layer after the first), every time inside it (a graph must own its tables: the cache drops
    entries)."""
    if cu_seqlens is None:
        return _dense_tables(batch, seqlen, device)
    key = (str(device), batch * seqlen)
    capturing = _capturing(device)
    tables = None if capturing else _recall(_SEQ_TABLES, cu_seqlens, key)
    if tables is not None:
        return tables
    cu_in = cu_seqlens.to(device)
    if cu_in.dtype not in (torch.int32, torch.int64):
        cu_in = cu_in.to(torch.int32)
    n = cu_in.numel()
    n_slots = _n_slots(batch * seqlen, n - 1)
    # kept for the later calls with this cu_seqlens (a model's other GDN layers): from a pool of their own
    with contextlib.nullcontext() if capturing else _lasting_pool(device):
        tables = torch.empty(2 * n_slots + 3 * n - 1, device=device, dtype=torch.int32)
    spans, cu, offsets, order = tables.split([2 * n_slots, n, n, n - 1])  # spans first: 8-byte aligned rows
    spans = spans.view(n_slots, 2)
    seq_tables.seq_tables(cu_dtype=str(cu_in.dtype).removeprefix("torch."))(cu_in.contiguous(), cu, offsets, spans,
                                                                          order)
    if capturing:
        return cu, offsets, order, spans
    return _remember(_SEQ_TABLES, cu_seqlens, (cu, offsets, order, spans), key)


_DENSE_TABLES: dict = {}


def _dense_tables(batch, seqlen, device):
    """:func:`_tables` of ``batch`` sequences of ``seqlen`` tokens, built once per shape (four launches fewer per
    call; a captured call reuses them, kept for good then, or where none are cached builds them by those launches,
    uncached)."""
    key = (str(device), batch, seqlen)
    capturing = _capturing(device)
    if key not in _DENSE_TABLES:
        where = device if capturing else "cpu"
        steps = torch.arange(batch + 1, device=where, dtype=torch.int32)
        chunks = (seqlen + CHUNK - 1) // CHUNK  # per sequence
        slot = torch.arange(_n_slots(batch * seqlen, batch), device=where, dtype=torch.int32)
        seq, j = slot // max(chunks, 1), slot % max(chunks, 1)
        start = seq * seqlen + j * CHUNK
        spans = torch.stack([start, (seqlen - j * CHUNK).clamp(max=CHUNK)], 1) * (seq < batch).unsqueeze(1)
        # spans first: their rows are read as 8-byte vectors
        flat = torch.cat([spans.flatten(), steps * seqlen, steps * chunks, steps[:-1]])
        sizes = [spans.numel(), batch + 1, batch + 1, batch]
        if capturing:
            spans, *rows = flat.split(sizes)
            return (*rows, spans.view(-1, 2))
        spans, *rows = lasting_copy(flat, device).split(sizes)
        _cache_put(_DENSE_TABLES, key, (*rows, spans.view(-1, 2)))
    return _held(_DENSE_TABLES, key, capturing)


def _onchip_tables(cu_seqlens, lens, batch, seqlen, device):
    """``(cu_seqlens, order, ht_rows)`` of the on-chip split-state launch (``ht_rows`` = [0]: sequence n's final
    state into row n). No launch where the host knows the lengths ``lens`` of an int32 or int64 ``cu_seqlens`` on
    ``device``: the kernel reads that tensor itself and the order (most chunks first, ties in index order) comes
    from ``lens``, built once per set of lengths (a captured call reuses it, kept for good then). The order only
    schedules, so a CUDA graph replayed on other lengths written into the same tensor stays correct (its order is
    then no longer longest first, as its walking choice was made for the lengths at capture). Else
    :func:`_tables` (``seq_tables``' order: longest first up to 1024 sequences)."""
    if (cu_seqlens is not None and lens is not None and cu_seqlens.device == device
            and cu_seqlens.dtype in (torch.int32, torch.int64) and cu_seqlens.is_contiguous()):
        key = (str(device), tuple(lens))
        capturing = _capturing(device)
        if key not in _ORDERS and not capturing:
            chunks = [-(-n // CHUNK) for n in lens]
            rows = [0] + sorted(range(len(lens)), key=lambda n: -chunks[n])
            _cache_put(_ORDERS, key, lasting_copy(torch.tensor(rows, dtype=torch.int32), device))
        if key in _ORDERS:
            rows = _held(_ORDERS, key, capturing)
            return cu_seqlens, rows[1:], rows[:1]
    cu, _, order, _ = _tables(cu_seqlens, batch, seqlen, device)
    return cu, order, cu[:1]


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if not hopper_supported(q, k, v):
        raise ValueError(
            f"chunk_gdr_fwd_hopper: unsupported inputs q{tuple(q.shape)} {q.dtype}, v{tuple(v.shape)} {v.dtype} "
            f"on {q.device}: need SM90 CUDA, bf16/fp16, K = V in {_HEAD_DIMS}, H_v % H_qk == 0"
        )
    B, T, _, _ = q.shape
    h_v = v.shape[2]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, h_v):
            raise ValueError(f"{name} must have shape {(B, T, h_v)}, got {tuple(t.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got {tuple(cu_seqlens.shape)}")
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, h_v, q.shape[3], v.shape[3]):
        raise ValueError(
            f"initial_state must have shape {(n, h_v, q.shape[3], v.shape[3])}, got {tuple(initial_state.shape)}"
        )


class _Pieces(NamedTuple):
    """Device int32 tables of a context-parallel plan (``chunking.pieces``), views of one tensor, and its piece
    length."""

    cu: torch.Tensor  # [P+1] token bounds of the pieces
    offsets: torch.Tensor  # [P+1] first chunk slot of each piece
    order: torch.Tensor  # [P] launch order of the recurrent kernels, longest piece first (as ``_tables``)
    seq_pieces: torch.Tensor  # [N+1] first piece of each sequence
    final_fwd: torch.Tensor  # [P] nonzero: the forward needs no transition of the piece (a sequence's last)
    final_bwd: torch.Tensor  # [P] the same for the backward (a sequence's only piece)
    first: torch.Tensor  # [P] nonzero: a sequence's first piece (its backward transition is not needed)
    ht_row: torch.Tensor  # [P] the sequence whose final state a piece gives (its last piece), else -1
    dh0_row: torch.Tensor  # [P] the sequence whose initial-state gradient a piece gives (its first piece), else -1
    chunks: int  # the piece length in 64-token chunks
    walk: bool  # whether the on-chip forward over the pieces walks them (``_walks`` of the piece lengths)


_TABLE_POOLS: dict = {}


def _lasting_pool(device):
    """A context in which ``device``'s allocations come from a memory pool of its own, for caches that outlive the
    call: a CUDA-graph tree's warm-up run (``torch.compile(mode="reduce-overhead")``) allocates from its private
    pool and must find only its outputs alive there afterwards."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    key = str(device)
    if key not in _TABLE_POOLS:
        _TABLE_POOLS[key] = torch.cuda.MemPool()
    return torch.cuda.use_mem_pool(_TABLE_POOLS[key], device)


def lasting_copy(host, device):
    """``host`` (a CPU tensor) copied to ``device`` for a cache that outlives the call (:func:`_lasting_pool`)."""
    with _lasting_pool(device):
        return host.to(device)


def _piece_tables(lens, chunks, device):
    """The :class:`_Pieces` of cutting ``lens`` every ``chunks`` chunks, built once per plan (a captured call
    reuses it, kept for good then; None when it is not built yet and the stream is capturing)."""
    key = (str(device), tuple(lens), chunks)
    capturing = _capturing(device)
    if key not in _PIECE_TABLES:
        if capturing:
            return None
        cu, offs, seq_pieces, last = chunking.pieces(lens, chunks)
        order = sorted(range(len(last)), key=lambda p: offs[p] - offs[p + 1])  # stable: ties in piece order
        firsts = set(seq_pieces[:-1])
        first = [int(p in firsts) for p in range(len(last))]
        only = [int(last[p] and first[p]) for p in range(len(last))]
        seq_of = [n for n in range(len(seq_pieces) - 1) for _ in range(seq_pieces[n], seq_pieces[n + 1])]
        ht_row = [seq_of[p] if last[p] else -1 for p in range(len(last))]
        dh0_row = [seq_of[p] if first[p] else -1 for p in range(len(last))]
        rows = [cu, offs, order, seq_pieces, [int(x) for x in last], only, first, ht_row, dh0_row]
        flat = lasting_copy(torch.tensor([x for row in rows for x in row], dtype=torch.int32), device)
        _cache_put(_PIECE_TABLES, key, _Pieces(*flat.split([len(row) for row in rows]), chunks,
                                               _walks(_lengths(cu))))
    return _held(_PIECE_TABLES, key, capturing)


def _extra_pieces(lens, chunks):
    """Pieces of cutting ``lens`` every ``chunks`` chunks, beyond one per sequence (``chunking.pieces``)."""
    return sum(max(1, -(-n // (chunks * CHUNK))) - 1 for n in lens)


def cp_cache_numel(n_tok, n_seq, h_v: int, dk: int, dv: int):
    """Elements of the forward's context-parallel cache (fp32, 1-D) for a forward that a backward follows:
    an upper bound, from shapes alone, on what any plan of ``n_seq`` sequences of ``n_tok`` tokens in all
    needs (:func:`_cp_cache_views`), so that ``qla::chunk_gdr_fwd`` has no data-dependent output size; 0
    where no such plan splits (more than ``chunking.MAX_HEADS_BACKWARD`` v-heads). ``n_tok`` and ``n_seq`` may be
    SymInts.

    A plan has one piece per sequence plus at most ``sum(chunks) // 8`` more (its pieces are at least 8 chunks)
    and at most ``_CP_MAX_EXTRA_PIECE_HEADS // h_v`` more (``_cp_plan``); each piece holds K x V + K x K
    fp32 values and one int32 per v-head."""
    if h_v > chunking.MAX_HEADS_BACKWARD:
        return 0
    chunks = n_tok // CHUNK + n_seq  # a bound on the chunks of all sequences
    extra = torch.sym_min(_CP_MAX_EXTRA_PIECE_HEADS // h_v, chunks // chunking.MIN_BACKWARD_PIECE_CHUNKS)
    return (n_seq + extra) * h_v * (dk * dv + dk * dk + 1)


def _check_context_parallel(context_parallel):
    if context_parallel is not None and context_parallel is not False and (
            isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1):
        raise ValueError(f"context_parallel must be None (choose), False (never split) or a piece length in "
                         f"64-token chunks >= 1, got {context_parallel!r}")


def _cp_plan(choice, cu_seqlens, batch, seqlen, h_v, device, backward):
    """The :class:`_Pieces` of the context-parallel plan when the kernels run context-parallel, else None
    (``choice``: the caller's ``context_parallel`` argument; ``backward``: the plan of a forward and backward pair,
    ``chunking.piece_chunks``)."""
    # a forward alone reads the lengths only where a split may come of it; with a backward to follow they also give
    # the backward's launch table (``backward._grads_order``)
    hopeless = h_v > chunking.MAX_HEADS_BACKWARD if backward else not chunking.may_split(batch * seqlen, h_v)
    if choice is False or (choice is None and hopeless):
        return None
    lens = _host_lengths(cu_seqlens, batch, seqlen)
    if lens is None:
        return None
    if choice is None:
        chunks = chunking.piece_chunks(lens, h_v, _sm_count(device.index), backward)
        while chunks is not None and _extra_pieces(lens, chunks) * h_v > _CP_MAX_EXTRA_PIECE_HEADS:
            chunks *= 2  # within what cp_cache_numel provides for
    else:
        chunks = choice
    if chunks is None or max(lens) <= chunks * CHUNK:
        return None
    return _piece_tables(lens, chunks, device)


def _state_arg(state, h_v, dk, dv, device):
    """An optional state (initial state, final-state gradient) as the kernels take it: fp32 and
    contiguous, or a one-slot placeholder they do not read when it is None."""
    if state is None:
        return torch.empty(1, h_v, dk, dv, device=device, dtype=torch.float32)
    return state.to(torch.float32).contiguous()


def _n_slots(n_tok, n_seq):
    """Chunk slots of the per-chunk tables: a bound on the chunks of ``n_seq`` sequences of ``n_tok`` tokens
    in all, from shapes alone."""
    return n_tok // CHUNK + n_seq


def _chunk_tables(n_tok, n_seq, h_v, device):
    """Uninitialised per-chunk tables ``(tt, gb, bad)`` of :func:`_n_slots` slots (see
    :func:`chunk_gdr_fwd_hopper_aux`; ``bad``: int32 ``[n_slots, H_v]`` contraction flags, ``kkt_inverse``)."""
    n_slots = _n_slots(n_tok, n_seq)
    tt = torch.empty(n_slots, h_v, CHUNK, CHUNK, device=device, dtype=torch.float16)
    gb = torch.empty(n_slots, h_v, 2, CHUNK, device=device, dtype=torch.float32)
    bad = torch.empty(n_slots, h_v, device=device, dtype=torch.int32)
    return tt, gb, bad


def _token_gates(g, beta, n_tok, h_v):
    """The activated gates ``g``, ``beta`` (``[B, T, H_v]``, any float dtype) as the kernels read them: fp32
    ``[n_tok, H_v]``."""
    return (g.reshape(n_tok, h_v).to(torch.float32).contiguous(),
            beta.reshape(n_tok, h_v).to(torch.float32).contiguous())


def _gate_inverse(k3, g, beta, spans, tables, dtype, inverse=True, unit_keys=False):
    """``kkt_inverse`` into ``tables`` (from :func:`_chunk_tables`) for the packed ``k3``, the activated gates ``g``,
    ``beta`` and the chunk slots' ``spans`` (:func:`_tables`): one CTA per (chunk, v-head) where each v-head has its
    own keys, else one per (chunk, qk-head, group of its v-heads), which forms K K^T once for the group. Without
    ``inverse`` the gate tables and contraction flags alone (the grouped kernel without its inverse; ``tt`` is
    left as it is), with ``unit_keys`` (keys the forward L2-normalised) without reading K."""
    tt, gb, bad = tables
    n_tok, h_v = k3.shape[0], gb.shape[1]
    g_tok, b_tok = _token_gates(g, beta, n_tok, h_v)
    if not inverse:
        kkt_inverse.kkt_inverse(dk=k3.shape[2], dtype=dtype, inverse=False, unit_keys=unit_keys)(
            k3, g_tok, b_tok, spans, gb, bad)
        return
    kernel = kkt_inverse.kkt_inverse_tc if h_v == k3.shape[1] else kkt_inverse.kkt_inverse
    kernel(dk=k3.shape[2], dtype=dtype)(k3, g_tok, b_tok, spans, *tables)


def _onchip_inverse(n_ctas):
    """Whether an unsplit forward alone over all of V forms its gate tables and inverse inside the split-state
    recurrence (``chunk_fwd_split(inverse=True)``) instead of launching ``kkt_inverse`` before it: where ``n_ctas``
    (sequence, v-head) pairs about fill the SMs, so the inverse's work overlaps other CTAs' instead of lengthening
    the longest sequence's path (H100, ``bench/results/2026-12-05-fwd-onchip-stages.md``: 1.12-1.36x from 128
    pairs, GVA 1 to 4, sequences of 1024 to 4096 tokens, 1.04x at 192 pairs with one sequence of 3000 tokens among
    1000 and 77; 0.93x at 96 pairs with one long sequence)."""
    return n_ctas >= _ONCHIP_MIN_CTAS


def _block_dv(n_ctas, dv):
    """The DV tile of the state kernels: all of V, or half of it when few CTAs would run."""
    return dv if n_ctas >= _FULL_DV_MIN_CTAS else dv // 2


@functools.cache
def _sm_count(device_index):
    """The SM count of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _walks(lens):
    """Whether the on-chip split-state launch walks (at most one CTA per SM, each taking pairs from its queue) rather
    than giving every (sequence, v-head) pair a CTA: where the host knows the sequence lengths (``lens``, None when
    not) and none is shorter than ``_WALK_MIN_TOKENS``. H100 (``bench/results/2026-12-06-fwd-onchip-candidates.md``,
    session 22): walking 1.04-1.08x on batches of 512 and 4096 tokens a sequence, but 0.97-0.98x where most chunks
    belong to sequences of one or two chunks (one long prompt among many short ones), whose pairs cost more taken
    from the queue than launched as CTAs of their own."""
    return lens is not None and min(lens, default=0) >= _WALK_MIN_TOKENS


def _split_state(n_pairs, device, walk=False, **params):
    """``split_state_recurrence.chunk_fwd_split(**params)`` for ``n_pairs`` (sequence or piece, v-head) pairs, called
    as ``chunk_recurrence.chunk_fwd_ws``: its CTA count and ticket counter filled in after ``scale``. With ``walk``
    one CTA per SM at most, each walking the pairs its queue deals it, longest first (its next pair's first inverse
    and h0 go under the pair before: on chip 1.02-1.08x at 512x64, H100; over T~ walking was 0.94-0.98x there), the
    counter zeroed per call; else one CTA per pair."""
    kernel = split_state_recurrence.chunk_fwd_split(**params)
    n_cta = n_pairs
    if walk:
        n_cta = min(n_pairs, _sm_count(device.index))

    def launch(*args):
        # zeroed where the CTAs deal tickets; a launch with a CTA per pair never reads it
        ticket = (torch.zeros if n_cta < n_pairs else torch.empty)(1, device=device, dtype=torch.int32)
        return kernel(*args[:-2], n_cta, ticket, *args[-2:])

    return launch


def _state_kernel(dk, dv, dtype, has_h0, n_ctas, device, pdl=False):
    """The forward's chunk recurrence for ``n_ctas`` (sequence or piece, v-head) pairs:
    ``split_state_recurrence.chunk_fwd_split`` over all of V, else ``chunk_recurrence.chunk_fwd_ws`` over half of it
    (:func:`_block_dv`; ``pdl``: launched right after ``kkt_inverse``, the split-state one always may be); the same
    call and outputs."""
    if _block_dv(n_ctas, dv) == dv:
        return _split_state(n_ctas, device, dk=dk, dv=dv, dtype=dtype, has_h0=has_h0)
    return chunk_recurrence.chunk_fwd_ws(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, block_dv=dv // 2, pdl=pdl)


def _cp_cache_views(cache, n_p, h_v, dk, dv):
    """``(h0p, m, skip)`` of a context-parallel cache (the leading elements of one flat fp32 tensor): the
    pieces' initial states fp32 ``[P, H_v, K, V]``, their transitions fp32 ``[P, H_v, K, K]`` and skip table
    int32 ``[P, H_v]``; None when ``cache`` is too small for P pieces."""
    a, b, c = n_p * h_v * dk * dv, n_p * h_v * dk * dk, n_p * h_v
    if cache is None or cache.numel() < a + b + c:
        return None
    return (cache[:a].view(n_p, h_v, dk, dv), cache[a:a + b].view(n_p, h_v, dk, dk),
            cache[a + b:a + b + c].view(torch.int32).view(n_p, h_v))


# The plan each live context-parallel cache was filled for (None: not filled), by its address, so that a
# backward uses a cache only for the plan it holds (a forward captured before the sequence lengths were
# known runs unsplit, and its backward may know them).
_CACHE_PLANS: dict = {}
_CACHE_PLANS_SIZE = 4096


def _record_cache_plan(cache, pieces):
    # a backward whose record is gone (the bound emptied the records) recomputes what the cache held
    _cache_put(_CACHE_PLANS, cache.data_ptr(), pieces, _CACHE_PLANS_SIZE)


def cached_plan_views(cache, pieces, h_v, dk, dv):
    """The :func:`_cp_cache_views` of a forward's ``cache`` when that forward filled it for ``pieces``, else
    None."""
    if cache is None or cache.numel() == 0 or _CACHE_PLANS.get(cache.data_ptr()) is not pieces:
        return None
    return _cp_cache_views(cache, pieces.order.numel(), h_v, dk, dv)


def _scan_block_dv(n_chains, dv, device):
    """The forward scan's columns per CTA for ``n_chains`` (sequence, v-head) chains: the fewest (8, 16 or 32) that
    keep its CTAs within one per SM, as each walks its chain alone and its product with M is most of a step (H100,
    ``bench/results/2026-12-06-fwd-cp-scan-columns.md``: 16 pieces at 8 v-heads 17 us at 8 columns against 36 us at
    32, at 16 v-heads 33 against 38 us; from 32 v-heads 32 columns are the fastest)."""
    return next((b for b in (8, 16) if n_chains * (dv // b) <= _sm_count(device.index)), 32)


def _piece_initial_states(q3, k3, v3, tt, gb, bad, initial_state, dtype, pieces, backward=False, cache=None,
                          sparse=None):
    """Every piece's initial state from ``context_parallel``, for the :class:`_Pieces` ``pieces`` (``tt, gb, bad`` from
    ``kkt_inverse``): ``(h0p, block_dv, skip,
    m, cache)``, h0p fp32 ``[P, H_v, K, V]``; ``skip`` and the transitions ``m`` as the transition kernel left
    them (M formed where ``skip < 0``); ``cache`` the flat tensor they are views of (:func:`_cp_cache_views`):
    the given one where it is large enough, else a new one.
    With ``backward`` M is also formed for the last piece of a sequence with several (the backward's reverse
    scan needs M of every piece but the first). With ``sparse = (beta, spans)`` (:func:`_sparse_inverse`; ``beta``
    fp32 ``[n_tok, H_v]``) ``kkt_inverse`` wrote only ``gb`` and ``bad``, and T~ is formed here into ``tt`` for
    the chunks the transitions run."""
    h_v, dk, dv = v3.shape[1], k3.shape[2], v3.shape[2]
    n_p = pieces.order.numel()
    f32 = dict(device=q3.device, dtype=torch.float32)
    views = _cp_cache_views(cache, n_p, h_v, dk, dv)
    if views is None:
        cache = torch.empty(n_p * h_v * (dk * dv + dk * dk + 1), **f32)
        views = _cp_cache_views(cache, n_p, h_v, dk, dv)
    h0p, m, skip = views
    n_pairs, n_sm = n_p * h_v, _sm_count(q3.device.index)
    # a forward alone may walk an exact piece in sub-walks side by side, their maps in n_sm // 2 slots beyond the
    # pieces'; a plan a backward reuses keeps one walk a piece
    n_sub_max = 1 if backward else chunking.sub_walks(pieces.chunks)
    # the transitions from a work list, exact walks first, only where their CTAs would not all run in one wave
    # (``bench/results/2026-12-07-fwd-cp-work-list-h100.md``: else its zeroed counters and reads cost ~3 us)
    listed = n_sub_max > 1 or 2 * n_pairs > n_sm
    n_slots = n_pairs + (n_sm // 2 if n_sub_max > 1 else 0)
    maps = m.view(n_pairs, dk, dk) if n_slots == n_pairs else torch.empty(n_slots, dk, dk, **f32)
    counts = (torch.zeros if listed else torch.empty)(2, device=q3.device, dtype=torch.int32)
    pairs = torch.empty(n_pairs, device=q3.device, dtype=torch.int32)
    final = pieces.final_bwd if backward else pieces.final_fwd
    if sparse is None:
        context_parallel.warmup_plan()(gb, bad, pieces.offsets, final, skip, counts, pairs, int(listed))
    else:
        b_tok, spans = sparse
        need = torch.empty_like(bad)
        context_parallel.warmup_plan(need=True)(gb, bad, pieces.offsets, final, skip, counts, pairs, int(listed),
                                                need)
        kkt_inverse.kkt_inverse_tc(dk=dk, dtype=dtype, needed=True)(k3, b_tok, spans, need, tt)
    e = torch.empty(n_slots, dk, dv, **f32)
    context_parallel.transitions(dk=dk, dv=dv, dtype=dtype)(k3, v3, tt, gb, pieces.cu, pieces.offsets, skip, counts,
                                                           pairs, int(listed), n_sub_max, n_sm,
                                                           2 * n_pairs + (n_sm if listed else 0), e, maps)
    if n_sub_max > 1:
        context_parallel.compose(dk=dk, dv=dv)(e, maps, counts, pairs, n_sub_max, n_sm, n_sm // 4)
    e, m = e[:n_pairs].view(n_p, h_v, dk, dv), maps[:n_pairs].view(n_p, h_v, dk, dk)
    has_h0 = initial_state is not None
    h0 = initial_state.to(torch.float32).contiguous() if has_h0 else e[:1]
    n_chains = (pieces.seq_pieces.numel() - 1) * h_v
    context_parallel.scan(dk=dk, dv=dv, has_h0=has_h0, block_dv=_scan_block_dv(n_chains, dv, q3.device))(
        e, m, skip, pieces.seq_pieces, h0, h0p)
    return h0p, _block_dv(n_p * h_v, dv), skip, m, cache


def _sparse_inverse(pieces, h_qk, h_v, dv, for_backward):
    """Whether a context-parallel forward over ``pieces`` forms T~ only for the chunks its transitions run and runs
    the pass over the pieces with the inverse on chip (``kkt_inverse`` first writes the gate tables alone): a
    forward alone whose v-heads have their own keys (``kkt_inverse_tc``: K K^T per v-head, the costly case) and
    whose (piece, v-head) pairs fill the SMs (:func:`_onchip_inverse`). A forward that a backward follows keeps
    every chunk's T~ for it."""
    n_pairs = pieces.order.numel() * h_v
    return not for_backward and h_v == h_qk and _block_dv(n_pairs, dv) == dv and _onchip_inverse(n_pairs)


def _forward_cp(q3, k3, v3, tt, gb, bad, scale, initial_state, dtype, pieces, for_backward, cache=None, sparse=None):
    """The fused forward over the :class:`_Pieces` ``pieces``, their initial states from ``context_parallel``:
    ``(o, final_state, cache)`` (``cache`` as ``_piece_initial_states`` with ``backward=for_backward``). With
    ``sparse = (g, beta, spans)`` (where :func:`_sparse_inverse`; the token gates as :func:`_token_gates` gives
    them), ``kkt_inverse`` wrote only the gate tables and the pieces run with the inverse on chip."""
    h_v, dk, dv = v3.shape[1], k3.shape[2], v3.shape[2]
    n_pairs = pieces.order.numel() * h_v
    h0p, _, _, _, cache = _piece_initial_states(q3, k3, v3, tt, gb, bad, initial_state, dtype, pieces,
                                                for_backward, cache, None if sparse is None else sparse[1:])
    o = torch.empty_like(v3)
    ht = torch.empty(pieces.seq_pieces.numel() - 1, *h0p.shape[1:], device=h0p.device, dtype=h0p.dtype)
    if sparse is not None:
        kernel = _split_state(n_pairs, q3.device, pieces.walk, dk=dk, dv=dv, dtype=dtype, has_h0=True, inverse=True)
        kernel(q3, k3, v3, *sparse[:2], pieces.cu, pieces.order, pieces.ht_row, h0p, float(scale), o, ht)
    else:
        kernel = _state_kernel(dk, dv, dtype, True, n_pairs, q3.device)
        kernel(q3, k3, v3, tt, gb, pieces.cu, pieces.offsets, pieces.order, pieces.ht_row, h0p, float(scale), o, ht)
    return o, ht, cache


def chunk_gdr_fwd_hopper_aux(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                             use_qk_l2norm: bool = False, context_parallel=None, for_backward: bool = True,
                             keys_normalised: bool = False):
    """The forward plus the aux a backward can reuse.

    Returns ``(o, final_state, tt, gb, chunk_offsets, cp_cache)``. Chunk j of sequence n is slot
    ``chunk_offsets[n] + j`` (int32 ``[N+1]``) of ``n_slots = B*T // 64 + N`` slots (the unused tail slots
    hold garbage). ``tt``: T~ = (I + strictly_lower(diag(beta) K K^T))^-1, fp16 ``[n_slots, H_v, 64, 64]``;
    ``gb``: fp32 ``[n_slots, H_v, 2, 64]``, row 0 the in-chunk inclusive cumsum of g, row 1 beta; rows past
    a sequence's end have g = beta = 0 (so gamma repeats the last value and T~ has unit rows there).
    Without ``for_backward`` (a forward alone) ``tt`` and ``gb`` come back empty: they are then only scratch,
    and where the inverse is formed on chip (:func:`_onchip_inverse`) not even that (no chunk slots: then
    ``chunk_offsets`` is empty too, and with the sequence lengths known no tables are built, :func:`_onchip_tables`).
    With ``use_qk_l2norm`` the kernels see the normalised q, k (done here with torch ops); ``keys_normalised``: the
    caller normalised k already (as ``dispatch`` does in its input-activation launch), so that, as with
    ``use_qk_l2norm``, a context-parallel gate pass need not read k for the contraction flags.
    ``context_parallel``: None chooses (``chunking.piece_chunks``, with ``for_backward`` the rule of a forward
    and backward pair), False never splits, an int splits every longer sequence into pieces of that many
    chunks. ``cp_cache``: with ``for_backward``, a flat fp32 tensor of :func:`cp_cache_numel` elements (a size
    known from shapes) that holds, when the forward ran context-parallel, the pieces' initial states,
    transitions and skip table (``_cp_cache_views``; the transitions formed for a backward, so it skips that
    plan; :func:`cached_plan_views` tells a backward whether and for which plan it was filled); else empty.
    Tokens after ``cu_seqlens[-1]`` are not written.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    _check_context_parallel(context_parallel)
    B, T, h_qk, dk = q.shape
    h_v, dv = v.shape[2], v.shape[3]
    dtype = _DTYPES[q.dtype]
    if use_qk_l2norm:
        q, k = l2norm_fp32(q), l2norm_fp32(k)
    n_tok = B * T
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cache = torch.empty(cp_cache_numel(n_tok, n_seq, h_v, dk, dv) if for_backward else 0, device=q.device,
                        dtype=torch.float32)
    if cache.numel():
        _record_cache_plan(cache, None)
    if n_tok == 0:
        ht = torch.zeros(n_seq, h_v, dk, dv, device=q.device, dtype=torch.float32)
        if initial_state is not None:
            ht.copy_(initial_state)
        tt, gb, _ = _chunk_tables(n_tok, n_seq if for_backward else 0, h_v, q.device)
        return v.new_empty(v.shape), ht, tt, gb, torch.zeros(n_seq + 1, device=q.device, dtype=torch.int32), cache
    q3 = q.reshape(n_tok, h_qk, dk).contiguous()
    k3 = k.reshape(n_tok, h_qk, dk).contiguous()
    v3 = v.reshape(n_tok, h_v, dv).contiguous()
    cp = _cp_plan(context_parallel, cu_seqlens, B, T, h_v, q.device, for_backward)
    has_h0 = initial_state is not None
    if cp is None and not for_backward and _block_dv(n_seq * h_v, dv) == dv and _onchip_inverse(n_seq * h_v):
        # no chunk slots, no gate tables: the gates and the inverse formed inside the split-state recurrence
        lens = _host_lengths(cu_seqlens, B, T, read=False)
        cu, order, ht_rows = _onchip_tables(cu_seqlens, lens, B, T, q.device)
        kernel = _split_state(n_seq * h_v, q.device, _walks(lens), dk=dk, dv=dv, dtype=dtype, has_h0=has_h0,
                              inverse=True, cu_dtype=str(cu.dtype).removeprefix("torch."))
        o = torch.empty_like(v3)
        ht = torch.empty(n_seq, h_v, dk, dv, device=q.device, dtype=torch.float32)
        h0 = _state_arg(initial_state, h_v, dk, dv, q.device)
        kernel(q3, k3, v3, *_token_gates(g, beta, n_tok, h_v), cu, order, ht_rows, h0, float(scale), o, ht)
        tt, gb, _ = _chunk_tables(0, 0, h_v, q.device)
        return o.view(B, T, h_v, dv), ht, tt, gb, order.new_empty(0), cache
    cu, offsets, order, spans = _tables(cu_seqlens, B, T, q.device)
    tt, gb, bad = _chunk_tables(n_tok, n_seq, h_v, q.device)
    kept = (tt, gb) if for_backward else (tt[:0], gb[:0])
    sparse = cp is not None and _sparse_inverse(cp, h_qk, h_v, dv, for_backward)
    if sparse:  # converted once for the gate tables and the pass over the pieces
        g, beta = _token_gates(g, beta, n_tok, h_v)
    _gate_inverse(k3, g, beta, spans, (tt, gb, bad), dtype, inverse=not sparse,
                  unit_keys=use_qk_l2norm or keys_normalised)
    if cp is not None:
        o, ht, filled = _forward_cp(q3, k3, v3, tt, gb, bad, scale, initial_state, dtype, cp, for_backward, cache,
                                    (g, beta, spans) if sparse else None)
        if for_backward:  # an explicit context_parallel may need more than the chosen plans' bound
            cache = filled
            _record_cache_plan(cache, cp)
        return o.view(B, T, h_v, dv), ht, *kept, offsets, cache
    o = torch.empty_like(v3)
    ht = torch.empty(n_seq, h_v, dk, dv, device=q.device, dtype=torch.float32)
    h0 = _state_arg(initial_state, h_v, dk, dv, q.device)
    # launched as kkt_inverse's last CTAs run
    kernel = _state_kernel(dk, dv, dtype, has_h0, n_seq * h_v, q.device, pdl=True)
    kernel(q3, k3, v3, tt, gb, cu, offsets, order, cu[:1], h0, float(scale), o, ht)  # cu[:1] = [0]: walk n to row n
    return o.view(B, T, h_v, dv), ht, *kept, offsets, cache


def chunk_gdr_fwd_hopper(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                         use_qk_l2norm: bool = False, context_parallel=None):
    """GDN chunked forward on SM90.

    q, k: ``[B, T, H_qk, K]``; v: ``[B, T, H_v, V]`` (bf16 or fp16, same dtype); g: ``[B, T, H_v]`` log-space
    gate (<= 0, fp32 or q's dtype); beta: ``[B, T, H_v]`` (already activated); initial_state: fp32
    ``[N, H_v, K, V]`` or None; cu_seqlens: ``[N+1]`` int (B == 1) or None.
    Returns ``o`` ``[B, T, H_v, V]`` in v's dtype and the fp32 final state ``[N, H_v, K, V]``.
    """
    o, ht, *_ = chunk_gdr_fwd_hopper_aux(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                                         context_parallel, for_backward=False)
    return o, ht
