"""Prefix radix tree over token ids, one node per full KV block.

    root(salt) ── [t0..t15] ── [t16..t31] ── ...
                           └── [t16'..t31'] ── ...

A node's key is the block_size token ids of its block; its path from the
root spells a prompt prefix. A tenant's salt selects its own root, so equal
prompts of two tenants never share a node.

Invariants (check_integrity() asserts them in KVCacheManager):
  * ref_count(node) = number of live sequences whose table holds the node;
  * ref_count(parent) >= ref_count(child): a sequence using a block uses
    every block before it;
  * hence the unreferenced nodes are whole subtrees, evicted leaf-first in
    least-recently-used order.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Hashable, Iterator, Sequence

from deepserve.cache.block_hash import chain_hash, root_hash

Key = tuple[int, ...]


class RadixNode:
    __slots__ = ("key", "block_id", "parent", "children", "ref_count", "last_access",
                 "block_hash")

    def __init__(self, key: Key, block_id: int, parent: "RadixNode | None", block_hash: int):
        self.key = key
        self.block_hash = block_hash  # chains the parent's: see cache/block_hash.py
        self.block_id = block_id
        self.parent = parent
        self.children: dict[Key, RadixNode] = {}
        self.ref_count = 0
        self.last_access = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_evictable_leaf(self) -> bool:
        return not self.children and self.ref_count == 0 and not self.is_root


class RadixTree:
    """record_events: keep the hashes of inserted / evicted nodes until
    pop_events() (a TE reports them to the cluster manager)."""

    def __init__(self, block_size: int, record_events: bool = False):
        self.block_size = block_size
        self.record_events = record_events
        self._inserted: list[int] = []
        self._evicted: list[int] = []
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = itertools.count(1)
        # Evictable leaves (unreferenced, childless), kept current on every
        # change so that evict() never walks the whole tree.
        self._leaves: dict[int, RadixNode] = {}
        self.num_nodes = 0
        self.num_unreferenced = 0  # nodes with ref_count 0: all evictable, leaf-first

    def root(self, salt: Hashable = None) -> RadixNode:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = RadixNode((), -1, None, root_hash(salt))
        return node

    def match(self, token_ids: Sequence[int], salt: Hashable = None,
              max_blocks: int | None = None) -> list[RadixNode]:
        """The longest chain of nodes whose keys spell a prefix of token_ids."""
        bs = self.block_size
        limit = len(token_ids) // bs if max_blocks is None else min(max_blocks, len(token_ids) // bs)
        node, path = self._roots.get(salt), []
        for i in range(limit):
            if node is None:
                break
            node = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if node is not None:
                path.append(node)
        return path

    def child(self, parent: RadixNode, key: Key) -> RadixNode | None:
        return parent.children.get(key)

    def insert(self, parent: RadixNode, key: Key, block_id: int) -> RadixNode:
        """Add a node under parent (the key must be new); it starts unreferenced."""
        assert len(key) == self.block_size and key not in parent.children
        node = RadixNode(key, block_id, parent, chain_hash(parent.block_hash, key))
        node.last_access = next(self._clock)
        if self.record_events:
            self._inserted.append(node.block_hash)
        parent.children[key] = node
        self._leaves.pop(id(parent), None)
        self._leaves[id(node)] = node
        self.num_nodes += 1
        self.num_unreferenced += 1
        return node

    def acquire(self, nodes: Sequence[RadixNode]) -> None:
        now = next(self._clock)
        for node in nodes:
            if node.ref_count == 0:
                self.num_unreferenced -= 1
                self._leaves.pop(id(node), None)
            node.ref_count += 1
            node.last_access = now

    def release(self, nodes: Sequence[RadixNode]) -> None:
        now = next(self._clock)
        for node in nodes:
            assert node.ref_count > 0, "release of an unreferenced node"
            node.ref_count -= 1
            node.last_access = now
            if node.ref_count == 0:
                self.num_unreferenced += 1
                if node.is_evictable_leaf:
                    self._leaves[id(node)] = node

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to num_blocks unreferenced nodes, least recently used
        leaves first; return their block ids."""
        heap = [(n.last_access, id(n), n) for n in self._leaves.values()]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            del self._leaves[id(node)]
            self.num_nodes -= 1
            self.num_unreferenced -= 1
            freed.append(node.block_id)
            if self.record_events:
                self._evicted.append(node.block_hash)
            if parent.is_evictable_leaf:
                self._leaves[id(parent)] = parent
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evictable_leaf_ids(self) -> set[int]:
        """For integrity checks: the leaves evict() would choose from."""
        return set(self._leaves)

    def pop_events(self) -> tuple[list[int], list[int]]:
        """(inserted, evicted) block hashes since the last call."""
        events = self._inserted, self._evicted
        self._inserted, self._evicted = [], []
        return events

    def clear(self) -> list[int]:
        """Drop every unreferenced node (cache state is soft); return freed blocks."""
        return self.evict(self.num_unreferenced)

    def nodes(self) -> Iterator[RadixNode]:
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
