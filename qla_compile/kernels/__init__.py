"""Hopper (SM90) TileLang kernels of the GDN chunked prefill, forward and backward, one module per kernel family.

Kernels (TileLang, one compile per variant, see :mod:`._build`):

* ``kkt_inverse`` -- per chunk, the gate cumsum and the gate-free inverse
  T~ = (I + strictly_lower(diag(beta) K K^T))^-1 (per group of v-heads sharing keys, or per v-head; the latter
  inverts its fp16 tile by the device code of ``tile_inverse``);
* ``seq_tables`` -- the varlen tables: int32 ``cu_seqlens``, chunk offsets and launch order;
* ``chunk_recurrence`` -- the warp-specialised chunk recurrence: o and the final state (also the backward's
  chunk-state recompute);
* ``split_state_recurrence`` -- the forward's chunk recurrence over all of V with the state in registers, split over
  two warpgroups (what the forward takes when every (sequence, v-head) pair fills a CTA);
* ``context_parallel`` -- intra-card context parallelism: the warm-up plan, the pieces' transitions (the affine
  map of each piece's state recurrence) and the scan of their initial states (or, in the backward, of their state
  gradients);
* ``reverse_recurrence`` -- the backward's warp-specialised reverse recurrence of the state gradient dS;
* ``chunk_grads`` -- the backward's per-chunk gradients dq, dk, dv, dg and dbeta.

Host code: ``forward`` (:func:`chunk_gdr_fwd_hopper`, :func:`chunk_gdr_fwd_hopper_aux`, what the kernels take)
and ``backward`` (``chunk_gdr_bwd_hopper``), with ``chunking`` (the chunk length and the context-parallel piece
plan). They reach the kernels through ``_build.kernel`` and import no TileLang module themselves, so that prebuilt
binaries load without TileLang's import.
"""

from ._build import TARGET, cache_dir
from .forward import chunk_gdr_fwd_hopper, chunk_gdr_fwd_hopper_aux, cp_cache_numel, hopper_supported, unsupported

__all__ = ["hopper_supported", "unsupported", "chunk_gdr_fwd_hopper", "chunk_gdr_fwd_hopper_aux", "cp_cache_numel",
           "TARGET", "cache_dir"]
