"""Approximate prefix cache of one worker: a character radix tree with LRU leaf eviction.

The cache_aware policy keeps one tree per worker holding the request texts it routed there, to
estimate how much of a new prompt that worker's prefix (radix) cache may already hold.
"""

from __future__ import annotations

import itertools


def common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix; binary search over slice compares (done in C)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "label", "parent", "stamp")

    def __init__(self, label: str, parent: _Node | None, stamp: int) -> None:
        self.label = label
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.stamp = stamp


class PrefixTree:
    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.root = _Node("", None, 0)
        self.size = 0  # characters stored on all edges

    def match(self, text: str) -> int:
        """How many leading characters of `text` the tree holds."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = common_prefix_len(child.label, text[i:i + len(child.label)])
            i += k
            if k < len(child.label):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        stamp = next(self._clock)
        node, i = self.root, 0
        node.stamp = stamp
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, stamp)
                node.children[text[i]] = leaf
                self.size += len(leaf.label)
                return
            k = common_prefix_len(child.label, text[i:i + len(child.label)])
            if k < len(child.label):
                # Split the edge: node -> mid(label[:k]) -> child(label[k:]).
                mid = _Node(child.label[:k], node, stamp)
                child.label = child.label[k:]
                child.parent = mid
                mid.children[child.label[0]] = child
                node.children[mid.label[0]] = mid
                child = mid
            child.stamp = stamp
            node = child
            i += k

    def evict_to(self, max_chars: int) -> None:
        """Drop least recently inserted leaves until at most ~90% of `max_chars` remain.

        Going below the cap leaves head-room so eviction runs once per many inserts.
        """
        if self.size <= max_chars:
            return
        target = int(max_chars * 0.9)
        while self.size > target:
            leaves = sorted(self._leaves(), key=lambda n: n.stamp)
            if not leaves:
                return
            for leaf in leaves:
                if self.size <= target:
                    break
                parent = leaf.parent
                assert parent is not None  # leaves are never the root
                del parent.children[leaf.label[0]]
                self.size -= len(leaf.label)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out
