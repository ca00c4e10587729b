"""The paged state pool of the reference (issue 30, docs/batching.md): many sequences' state, their compressed
rows and indexer keys in fixed-size pages shared through the prefix cache.

What is paged and what is not, and why:

* **Compressed rows and indexer keys** grow with the context: they live in pool pages of ``page_tokens``
  positions (``page_tokens // ratio`` compressed rows of each compressing layer, ``page_tokens // 4`` indexer keys
  of each ratio-4 layer). A sequence's page table maps its page k (positions ``k*P .. (k+1)*P - 1``) to a pool
  page; :class:`PagedRows` reads and writes through it, so the reference's step code indexes a paged sequence as
  it indexes a flat one.
* **The window ring and the compressors' partial state** stay with the sequence (a lane's own tensors): the ring
  is rewritten every step and never holds more than ``window`` rows, the partial state is a few rows. Paging the
  raw window rows instead would take two pages per sequence (the window straddles a boundary) and an indirection
  on every attention read, for nothing a prefix needs beyond what :class:`BoundaryState` keeps.
* **The boundary state** at a page boundary (a multiple of every compress ratio, so every block is complete
  there): the ring, and the ratio-4 compressors' previous block (rows 0..3 of their 8-slot state, which the next
  block's overlap reads). A compressor of ratio r > 4 overwrites all r slots before its next flush reads them,
  so its partial state at a boundary carries nothing and is not kept (a sequence continuing from a boundary
  starts those slots at their initial values; its outputs equal a fresh run's bit for bit, the tests check it).

``page_tokens`` must be a multiple of the window and of every compress ratio (:func:`ds4c.pages.default_page_tokens`:
their least common multiple, at least 16; 128 for DeepSeek-V4-Flash, the seed's and SGLang's page).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.errors import StepError
from ds4c.pages import PageAllocator, PrefixCache, PrefixNode, check_page_tokens, default_page_tokens
from ds4c.reference.primitives import act_dtype
from ds4c.reference.state import CompressorState, LayerState, SequenceState

POISON = float("nan")
"""What a freed page is filled with when the pool poisons (tests): a stale read shows as NaN logits."""


class PagedRows:
    """One layer's compressed rows (or indexer keys) of one sequence, read and written through its page table.

    Indexing as a ``[capacity, width]`` tensor: ``rows[i]`` (int), ``rows[a:b]`` (a slice), ``rows[idx]`` (an int64
    tensor; a negative entry reads a zero row: the reference's masked ``-1`` list entries); ``rows[i] = value``.
    A write into a page another holder shares (a cached prefix) first copies it to a page of this sequence's own
    (copy on write), so a sequence never changes what another reads."""

    def __init__(self, pool: "StatePool", seq: "PagedSequence", layer_pool: torch.Tensor):
        self._pool, self._seq, self._t = pool, seq, layer_pool
        self._rpp = int(layer_pool.shape[1])  # rows per page
        self.shape = torch.Size((len(seq.table) * self._rpp, int(layer_pool.shape[2])))
        self.dtype, self.device = layer_pool.dtype, layer_pool.device

    def _where(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(self._seq.table, dtype=torch.int64, device=self.device)
        return table[rows // self._rpp], rows % self._rpp

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, int):
            page, off = divmod(index, self._rpp)
            return self._t[self._seq.table[page], off]
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise StepError("paged rows: only unit-step slices")
            index = torch.arange(start, max(start, stop), dtype=torch.int64, device=self.device)
        if isinstance(index, torch.Tensor):
            idx = index.to(torch.int64)
            neg = idx < 0
            pages, offs = self._where(idx.clamp(min=0))
            out = self._t[pages, offs]
            if bool(neg.any()):
                out = torch.where(neg.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
            return out
        raise StepError(f"paged rows: unsupported index {type(index).__name__}")

    def __setitem__(self, index: Any, value: torch.Tensor) -> None:
        if not isinstance(index, int):
            raise StepError(f"paged rows: writes take one row index, found {type(index).__name__}")
        k, off = divmod(index, self._rpp)
        self._t[self._pool.own_page(self._seq, k), off] = value

    def clone(self) -> torch.Tensor:
        """The rows of every page of the table, flat (a copy)."""
        return self[0:self.shape[0]].clone()


@dataclass
class BoundaryState:
    """What a sequence needs beyond its pages to continue from a page boundary (module docstring): per layer
    the window ring, and for ratio-4 layers rows 0..3 of the main and indexer compressors' kv / score."""

    rings: list[torch.Tensor]
    partial: dict[int, tuple[torch.Tensor, ...]]


class PagedSequence(SequenceState):
    """A sequence whose compressed rows and indexer keys live in pool pages (:class:`PagedRows`); ``table`` is its
    page table (pool page of each of its pages), ``node`` the prefix cache node of its last cached full page.
    Create with :meth:`StatePool.new_sequence`; give its pages back with :meth:`StatePool.free`."""

    table: list[int]
    node: PrefixNode | None
    freed: bool

    def snapshot(self) -> SequenceState:
        raise StepError("a paged sequence has no whole-state snapshot (its pages may be shared)")

    def restore(self, snap: SequenceState) -> None:
        raise StepError("a paged sequence has no whole-state restore (its pages may be shared)")


class StatePool:
    """The paged pool: ``n_pages`` pages of ``page_tokens`` positions on ``device``, the page allocator and the
    prefix cache (module docstring).

    Args:
        cfg: the model's config.
        n_pages: pages in the pool.
        page_tokens: positions per page (None: :func:`default_page_tokens`).
        device: where the pages live.
        prefix_states: boundary states the prefix cache keeps (0: no prefix reuse).
        poison: fill a page with NaN when it is freed (tests: a read of a freed page shows).
    """

    def __init__(self, cfg: Ds4Config, n_pages: int, page_tokens: int | None = None,
                 device: str | torch.device = "cpu", prefix_states: int = 64, poison: bool = False):
        self.cfg = cfg
        self.page_tokens = default_page_tokens(cfg) if page_tokens is None else check_page_tokens(cfg, page_tokens)
        self.device = torch.device(device)
        self.poison = poison
        self.alloc = PageAllocator(n_pages, self._freed)
        self.prefix = PrefixCache(self.alloc, self.page_tokens, max(prefix_states, 0))
        self.prefix_reuse = prefix_states > 0
        P, act = self.page_tokens, act_dtype()
        self.comp: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        for i in range(cfg.n_layers):
            r = cfg.ratio(i)
            if r:
                self.comp[i] = torch.zeros(n_pages, P // r, cfg.head_dim, dtype=act, device=self.device)
            if r == 4:
                self.keys[i] = torch.zeros(n_pages, P // 4, cfg.index_head_dim, dtype=act, device=self.device)
        if poison:
            for p in range(n_pages):
                self._freed(p)

    # ------------------------------------------------------------------------------------------ sizes
    def pages_for(self, positions: int) -> int:
        """Pages a sequence of ``positions`` positions holds."""
        return -(-positions // self.page_tokens)

    # ------------------------------------------------------------------------------------------ sequences
    def new_sequence(self, max_ctx: int, reuse: list[PrefixNode] = ()) -> PagedSequence:
        """A reset sequence of ``max_ctx`` positions (a multiple of ``page_tokens`` is not needed) whose pages are
        allocated now; with ``reuse`` (:meth:`PrefixCache.match`'s nodes) it starts at the end of that prefix:
        its first pages are the nodes' (shared), its ring and partial state the last node's boundary state.

        Raises:
            StepError: not enough free pages (callers check :meth:`can_admit` first), a prefix as long as
                ``max_ctx``.
        """
        cfg, P = self.cfg, self.page_tokens
        n = self.pages_for(max_ctx)
        if len(reuse) >= n:
            raise StepError(f"a reused prefix of {len(reuse) * P} positions leaves nothing of max_ctx={max_ctx}")
        act = act_dtype()
        seq = PagedSequence(cfg, max_ctx, [])
        seq.table = [node.page for node in reuse]
        for node in reuse:
            self.alloc.incref(node.page)
        seq.table += self.alloc.alloc(n - len(reuse))
        seq.node = reuse[-1] if reuse else None
        seq.freed = False
        for i in range(cfg.n_layers):
            r = cfg.ratio(i)
            ls = LayerState(ring=torch.zeros(cfg.window, cfg.head_dim, dtype=act, device=self.device))
            if r:
                ls.comp = PagedRows(self, seq, self.comp[i])  # type: ignore[assignment]
                ls.comp_state = CompressorState.empty(r, (2 if r == 4 else 1) * cfg.head_dim, self.device)
            if r == 4:
                ls.idx_keys = PagedRows(self, seq, self.keys[i])  # type: ignore[assignment]
                ls.idx_state = CompressorState.empty(4, 2 * cfg.index_head_dim, self.device)
            seq.layers.append(ls)
        if reuse:
            self._load(seq, reuse[-1].state)
            seq.pos = len(reuse) * P
        return seq

    def can_admit(self, pages: int) -> bool:
        """Whether ``pages`` pages can be had now, evicting cached prefixes nobody runs if needed (they are
        evicted then)."""
        short = pages - self.alloc.free
        if short > 0:
            self.prefix.evict(short)
        return self.alloc.free >= pages

    def free(self, seq: PagedSequence) -> None:
        """Give back the sequence's pages (a cached prefix keeps its own references). Idempotent."""
        if not seq.freed:
            seq.freed = True
            self.alloc.release(seq.table)

    def own_page(self, seq: PagedSequence, k: int) -> int:
        """The pool page of the sequence's page ``k``, made its own first when it is shared (copy on write)."""
        page = seq.table[k]
        if self.alloc.refs[page] > 1:
            (new,) = self.alloc.alloc(1)
            for pool in (*self.comp.values(), *self.keys.values()):
                pool[new].copy_(pool[page])
            self.alloc.decref(page)
            seq.table[k] = page = new
        return page

    # ------------------------------------------------------------------------------------------ prefix cache
    def boundary(self, seq: PagedSequence) -> BoundaryState:
        """The sequence's boundary state now (copies; module docstring)."""
        partial = {}
        for i, ls in enumerate(seq.layers):
            if self.cfg.ratio(i) == 4:
                partial[i] = (ls.comp_state.kv[:4].clone(), ls.comp_state.score[:4].clone(),
                              ls.idx_state.kv[:4].clone(), ls.idx_state.score[:4].clone())
        return BoundaryState([ls.ring.clone() for ls in seq.layers], partial)

    def _load(self, seq: PagedSequence, st: BoundaryState) -> None:
        for i, ls in enumerate(seq.layers):
            ls.ring.copy_(st.rings[i])
            if i in st.partial:
                ckv, csc, ikv, isc = st.partial[i]
                ls.comp_state.kv[:4].copy_(ckv)
                ls.comp_state.score[:4].copy_(csc)
                ls.idx_state.kv[:4].copy_(ikv)
                ls.idx_state.score[:4].copy_(isc)

    def cache_page(self, seq: PagedSequence, tokens: list[int]) -> None:
        """Record the sequence's page ending at its position (a page boundary) in the prefix cache, with the
        boundary state now; ``tokens``: the ids at positions ``0 .. pos - 1``."""
        P = self.page_tokens
        k = seq.pos // P - 1
        if not self.prefix_reuse or seq.pos % P or k < 0 or len(tokens) < seq.pos:
            return
        if (0 if seq.node is None else seq.node.depth) != k:  # a boundary was skipped: the chain ends here
            return
        seq.node = self.prefix.insert(seq.node, tokens[k * P:(k + 1) * P], seq.table[k], self.boundary(seq))

    # ------------------------------------------------------------------------------------------ poison
    def _freed(self, page: int) -> None:
        if self.poison:
            for pool in (*self.comp.values(), *self.keys.values()):
                pool[page].fill_(POISON)
