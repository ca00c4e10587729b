"""Page bookkeeping of the paged state pool (issue 30, docs/batching.md): which fixed-size pages are free, who
holds each, and the prefix cache over them.

A page holds the rows of ``page_tokens`` consecutive positions of one sequence for every layer (compressed rows,
indexer keys): the tensors live with the engine (:mod:`ds4c.reference.paged`); this module counts integers only,
so the compiled step's pool can share it.

* :class:`PageAllocator`: a fixed number of pages; each has a reference count (the sequences whose page table
  holds it, plus the prefix cache when a cached prefix ends in it). A page whose count drops to zero is free
  again at once (``on_free`` is told, e.g. to poison it in tests).
* :class:`PrefixCache`: the full pages of the sequences that ran, keyed by a hash of every token up to the
  page's end (a chain: the key of page k covers pages 0..k). A node holds a reference to its page, so a
  finished sequence's full pages stay cached until evicted; it may also hold the *boundary state* at its end
  (what a sequence needs beyond the pages to continue from there: the window ring and the compressors' partial
  state). :meth:`PrefixCache.match` finds the longest cached prefix of a prompt that ends at a page boundary
  with a boundary state; :meth:`PrefixCache.evict` frees pages, least recently used leaves first, keeping every
  page a running sequence holds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4c.config import Ds4Config
from ds4c.errors import StepError


# ---------------------------------------------------------------------------------------------- sizes
def default_page_tokens(cfg: Ds4Config) -> int:
    """The smallest page that is a multiple of the window and of every compress ratio (and of 4, the indexer's
    ratio), at least 16 positions: 128 for DeepSeek-V4-Flash (window 128, ratios 4 and 128), 16 for ``tiny``."""
    lcm = _page_unit(cfg)
    return lcm * max(1, math.ceil(16 / lcm))


def check_page_tokens(cfg: Ds4Config, page_tokens: Any) -> int:
    """``page_tokens`` as an int. Raises StepError unless it is a positive multiple of the window and of every
    compress ratio (a page boundary must end every block and hold whole windows)."""
    base = _page_unit(cfg)
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1 or page_tokens % base:
        raise StepError(f"page_tokens must be a positive multiple of {base} (the window and every compress ratio of "
                        f"{cfg.name}), found {page_tokens!r}")
    return page_tokens


def _page_unit(cfg: Ds4Config) -> int:
    return math.lcm(cfg.window, 4, *(r for r in cfg.compress_ratios[:cfg.n_layers] if r))


def page_bytes(cfg: Ds4Config, page_tokens: int, elem: int = 2) -> int:
    """Bytes of one page: every layer's compressed rows and indexer keys of ``page_tokens`` positions (bf16)."""
    n = 0
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        if r:
            n += page_tokens // r * cfg.head_dim
        if r == 4:
            n += page_tokens // 4 * cfg.index_head_dim
    return n * elem


def lane_state_bytes(cfg: Ds4Config) -> int:
    """Bytes a sequence holds beside its pages: the window ring of every layer (bf16) and the compressors' fp32
    partial state (kv and score)."""
    n = cfg.n_layers * cfg.window * cfg.head_dim * 2
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        if r:
            n += 2 * 4 * (8 if r == 4 else r) * (2 if r == 4 else 1) * cfg.head_dim
        if r == 4:
            n += 2 * 4 * 8 * 2 * cfg.index_head_dim
    return n


class PageAllocator:
    """``n_pages`` pages with reference counts (module docstring).

    Args:
        n_pages: pages in the pool (>= 1).
        on_free: called with a page id when its count drops to zero (before it can be handed out again).
    """

    def __init__(self, n_pages: int, on_free: Callable[[int], None] | None = None):
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or n_pages < 1:
            raise StepError(f"the page pool needs at least one page, found {n_pages!r}")
        self.n_pages = n_pages
        self.refs = [0] * n_pages
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: the lowest ids first
        self._on_free = on_free

    @property
    def free(self) -> int:
        """Pages nobody holds."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages somebody holds."""
        return self.n_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, each now held once.

        Raises:
            StepError: fewer than ``n`` pages are free (callers check :attr:`free` first: admission control).
        """
        if n > len(self._free):
            raise StepError(f"the page pool has {len(self._free)} free pages, {n} were asked for")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def incref(self, page: int) -> None:
        """One more holder of ``page`` (which must be held already)."""
        if self.refs[page] < 1:
            raise StepError(f"page {page} is free: it cannot be shared")
        self.refs[page] += 1

    def decref(self, page: int) -> None:
        """One holder fewer; the page is free when none is left."""
        if self.refs[page] < 1:
            raise StepError(f"page {page} is already free")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if self._on_free is not None:
                self._on_free(page)
            self._free.append(page)

    def release(self, pages: Sequence[int]) -> None:
        """:meth:`decref` each of ``pages``."""
        for p in pages:
            self.decref(p)


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix cache's key of a page: a hash of the parent page's key and this page's token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


ROOT_KEY = b""
"""The parent key of a sequence's first page."""


@dataclass(eq=False)
class PrefixNode:
    """One cached full page: its ``key`` (:func:`page_key` chain), the ``page`` id, ``depth`` (pages 0..depth - 1
    are this prefix: it ends at position ``depth * page_tokens``), its ``parent`` node (None for a first page),
    the boundary state at its end (``state``: engine-defined; None when dropped or never taken) and when it was
    last used."""

    key: bytes
    page: int
    depth: int
    parent: "PrefixNode | None"
    state: Any = None
    children: int = 0
    last_used: int = 0
    _dead: bool = field(default=False, repr=False)


class PrefixCache:
    """The prefix cache (module docstring).

    Args:
        alloc: the pool's allocator (a node holds one reference to its page).
        page_tokens: positions per page.
        max_states: boundary states kept at most (each is as large as a sequence's window ring); the least
            recently used node loses its state first (its page stays: deeper nodes may still match).
    """

    def __init__(self, alloc: PageAllocator, page_tokens: int, max_states: int = 64):
        self.alloc, self.page_tokens, self.max_states = alloc, page_tokens, max_states
        self.nodes: dict[bytes, PrefixNode] = {}
        self._tick = 0
        self.hits = 0
        self.hit_tokens = 0

    def _touch(self, node: PrefixNode) -> None:
        self._tick += 1
        while node is not None:
            node.last_used = self._tick
            node = node.parent

    @property
    def states(self) -> int:
        """Nodes holding a boundary state."""
        return sum(n.state is not None for n in self.nodes.values())

    def insert(self, parent: PrefixNode | None, tokens: Sequence[int], page: int, state: Any) -> PrefixNode:
        """Cache the full page ``page`` holding ``tokens`` (``page_tokens`` ids) after ``parent`` (None: the first
        page), with the boundary state at its end. If that prefix is cached already, the existing node is kept
        (its state replaced when it had none) and returned; else the node takes a reference to ``page``."""
        if len(tokens) != self.page_tokens:
            raise StepError(f"a cached page holds {self.page_tokens} tokens, found {len(tokens)}")
        key = page_key(ROOT_KEY if parent is None else parent.key, tokens)
        node = self.nodes.get(key)
        if node is None:
            self.alloc.incref(page)
            node = PrefixNode(key, page, 1 if parent is None else parent.depth + 1, parent)
            self.nodes[key] = node
            if parent is not None:
                parent.children += 1
        self._touch(node)
        if node.state is None and state is not None:
            node.state = state
            self._trim_states()
        return node

    def _trim_states(self) -> None:
        held = [n for n in self.nodes.values() if n.state is not None]
        for n in sorted(held, key=lambda n: n.last_used)[:max(0, len(held) - self.max_states)]:
            n.state = None

    def match(self, tokens: Sequence[int]) -> list[PrefixNode]:
        """The nodes of the longest cached prefix of ``tokens`` that a sequence can start from: it ends at a page
        boundary strictly before the last token (at least one token is left to compute the first new token's
        logits from) and its last node holds a boundary state. ``[]``: none. Marks them used (a sequence that
        starts from them is counted by :meth:`record_hit`)."""
        P = self.page_tokens
        chain: list[PrefixNode] = []
        key = ROOT_KEY
        for k in range((len(tokens) - 1) // P):
            node = self.nodes.get(page_key(key, tokens[k * P:(k + 1) * P]))
            if node is None:
                break
            chain.append(node)
            key = node.key
        while chain and chain[-1].state is None:
            chain.pop()
        if chain:
            self._touch(chain[-1])
        return chain

    def record_hit(self, pages: int) -> None:
        """Count a sequence started from a matched prefix of ``pages`` pages (none: nothing counted)."""
        if pages:
            self.hits += 1
            self.hit_tokens += pages * self.page_tokens

    def evict(self, pages: int) -> int:
        """Drop least recently used leaf nodes whose page only the cache holds until ``pages`` pages were freed
        or none is left to drop; returns the pages freed."""
        freed = 0
        while freed < pages:
            leaves = [n for n in self.nodes.values() if n.children == 0 and self.alloc.refs[n.page] == 1]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_used)
            self._drop(victim)
            freed += 1
        return freed

    def evictable(self) -> int:
        """Pages :meth:`evict` could free now (chains of nodes whose pages only the cache holds)."""
        held = {n.key: self.alloc.refs[n.page] == 1 for n in self.nodes.values()}
        # a node can go once all its children have gone: count the nodes whose whole subtree is cache-only
        blocked: set[bytes] = set()
        for n in self.nodes.values():
            if not held[n.key]:
                p: PrefixNode | None = n
                while p is not None and p.key not in blocked:
                    blocked.add(p.key)
                    p = p.parent
        return sum(1 for k in self.nodes if k not in blocked)

    def _drop(self, node: PrefixNode) -> None:
        del self.nodes[node.key]
        node._dead = True
        node.state = None
        if node.parent is not None:
            node.parent.children -= 1
        self.alloc.decref(node.page)

    def clear(self) -> None:
        """Drop every node (their pages are freed unless a sequence still holds them)."""
        for node in sorted(self.nodes.values(), key=lambda n: -n.depth):
            self._drop(node)
