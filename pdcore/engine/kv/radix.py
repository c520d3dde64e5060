"""The prefix cache (RadixAttention): a radix tree of token ids over pages of the KV pool.

Granularity: a node holds whole pages, k pages keyed by their k * page_size token ids. Only full
pages enter the tree; a sequence's last, partial page stays its request's own, and a request
that matches a prefix computes from the first position its matched pages do not cover. (Chosen
over a token-exact partial-page match with copy-on-write: that saves less than one page of
compute per hit and costs a page copy on every hit.)

Ownership is the BlockManager's reference count, nothing else: the tree holds one reference on
each page it lists; a request using a matched page holds one more. So no page is ever freed
while a request uses it, and a page is "locked" exactly when its count is above one. Eviction
takes least-recently-used leaves whose tail pages only the tree holds. Because a request always
holds a prefix of a root path, a locked page's ancestors are locked too.

Every operation depends only on its inputs (the LRU clock is a counter, not wall time), so each
TP rank's copy of the tree stays identical to rank 0's.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from pdcore.engine.kv.blocks import BlockManager


class _Node:
    __slots__ = ("children", "key", "last_use", "pages", "parent", "seq")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None,
                 last_use: int, seq: int = 0) -> None:
        self.key = key  # len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], _Node] = {}  # by the child's first page of tokens
        self.parent = parent
        self.last_use = last_use
        self.seq = seq  # creation order: breaks LRU ties the same way on every TP rank


class RadixCache:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.ps = blocks.page_size
        self.root = _Node((), [], None, 0)
        self.num_pages = 0  # pages the tree lists (each holds one reference of the tree's)
        self.clock = 0
        self.evicted_pages = 0
        self.inserted_pages = 0
        self._seq = 0

    def _new(self, key: tuple[int, ...], pages: list[int], parent: _Node, last_use: int) -> _Node:
        self._seq += 1
        return _Node(key, pages, parent, last_use, self._seq)

    # ---- lookup -------------------------------------------------------------------------------
    def _common_pages(self, node: _Node, tokens: tuple[int, ...], start: int, limit: int) -> int:
        """How many of `node`'s pages equal the pages of `tokens` from page `start` on."""
        ps, k = self.ps, 0
        while k < len(node.pages) and start + k < limit:
            a = (start + k) * ps
            if node.key[k * ps:(k + 1) * ps] != tokens[a:a + ps]:
                break
            k += 1
        return k

    def match(self, tokens: Sequence[int], limit: int, touch: bool = True) -> list[int]:
        """The pages holding the longest cached prefix of `tokens[:limit]` (whole pages only).
        The caller takes its own reference on them (BlockManager.ref) before anything can
        evict; the walk marks them recently used unless `touch` is False (a look only)."""
        n = min(len(tokens), limit) // self.ps
        t = tuple(tokens[:n * self.ps])
        if touch:
            self.clock += 1
        node, i, out = self.root, 0, []
        while i < n:
            child = node.children.get(t[i * self.ps:(i + 1) * self.ps])
            if child is None:
                break
            k = self._common_pages(child, t, i, n)
            if touch:
                child.last_use = self.clock
            out.extend(child.pages[:k])
            i += k
            if k < len(child.pages):
                break
            node = child
        return out

    # ---- insert -------------------------------------------------------------------------------
    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after its first k pages; returns the new upper part."""
        ps, parent = self.ps, node.parent
        assert parent is not None and 0 < k < len(node.pages)
        upper = self._new(node.key[:k * ps], node.pages[:k], parent, node.last_use)
        parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps:], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of a sequence: `pages[i]` holds tokens [i*ps, (i+1)*ps). Pages of
        a prefix the tree already holds (under any page ids) are not taken; the rest get one
        reference of the tree's. Returns the number of pages newly cached."""
        n = min(len(pages), len(tokens) // self.ps)
        t = tuple(tokens[:n * self.ps])
        self.clock += 1
        node, i = self.root, 0
        while i < n:
            head = t[i * self.ps:(i + 1) * self.ps]
            child = node.children.get(head)
            if child is None:
                new = self._new(t[i * self.ps:], self.blocks.ref(list(pages[i:n])), node,
                                self.clock)
                node.children[head] = new
                self.num_pages += n - i
                self.inserted_pages += n - i
                return n - i
            k = self._common_pages(child, t, i, n)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_use = self.clock
            node, i = child, i + k
        return 0

    # ---- eviction -----------------------------------------------------------------------------
    def _free_tail(self, node: _Node) -> int:
        """Pages at the end of a leaf that only the tree holds."""
        k = 0
        for p in reversed(node.pages):
            if self.blocks.refcount(p) != 1:
                break
            k += 1
        return k

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def evict(self, want: int) -> int:
        """Free up to `want` pages, least recently used leaves first (their unlocked tail
        pages); returns the number freed."""
        heap = [(n.last_use, n.seq, n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < want:
            _, _, node = heapq.heappop(heap)
            tail = self._free_tail(node)
            if tail == 0:
                continue  # a request holds its last page: locked
            take = min(tail, want - freed)
            gone = node.pages[len(node.pages) - take:]
            node.pages = node.pages[:len(node.pages) - take]
            node.key = node.key[:len(node.pages) * self.ps]
            self.blocks.free(gone)
            freed += take
            self.num_pages -= take
            self.evicted_pages += take
            if not node.pages:
                parent = node.parent
                assert parent is not None
                for head, child in list(parent.children.items()):
                    if child is node:
                        del parent.children[head]
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.last_use, parent.seq, parent))
        return freed

    def evictable(self, at_least: int | None = None) -> int:
        """Pages eviction could free now: a node's unlocked tail counts once every child
        subtree below it is wholly unlocked (evicting them makes the node a leaf).

        With `at_least`, the count stops as soon as it reaches that many (the answer is then
        >= at_least exactly when the full count is): an allocation at a full pool asks this
        for every page it needs, and the full count reads every cached page's reference."""
        order, stack = [], [self.root]
        while stack:  # parents before children; walked backwards, children come first
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        whole: dict[int, bool] = {}
        total = 0
        for node in reversed(order):
            if not all(whole[id(c)] for c in node.children.values()):
                whole[id(node)] = False
                continue
            tail = self._free_tail(node)
            total += tail
            if at_least is not None and total >= at_least:
                return total
            whole[id(node)] = tail == len(node.pages)
        return total

    def reset(self) -> int:
        """Drop every page (no request may hold one: see Scheduler.flush_cache)."""
        stack, pages = [self.root], []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            pages.extend(node.pages)
        for p in pages:
            assert self.blocks.refcount(p) == 1, f"page {p} is in use; cannot flush"
        self.blocks.free(pages)
        self.root = _Node((), [], None, 0)
        self.num_pages = 0
        return len(pages)
