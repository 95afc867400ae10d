"""KVCacheManager: the RTC master's view of one TE's KV pool.

Every block id is in exactly one place:

    free list ──alloc──> private to one sequence ──commit──> radix tree node
        ^                        │ free                      │ refs -> 0
        └────────────────────────┘<─────── evict (LRU) ──────┘

A sequence's block table is [tree nodes..., private blocks...]: its leading
full, computed blocks are shared through the tree (ref-counted), the rest are
its own. commit() moves newly completed blocks into the tree; when an equal
block is already there, the sequence adopts the tree's block and gives its
own copy back (the KV is the same tokens' KV).

Lower tiers (engine/tiers/coordinator.py): with collect_new_nodes, every node commit()
inserts is kept until pop_new_nodes() (the master writes those blocks
through to the host tier); pin() holds a set of nodes and all their
ancestors (so ref_count(parent) >= ref_count(child) still holds) until
unpin(), while their blocks are copied out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from deepserve.cache.radix_tree import RadixNode, RadixTree


@dataclass
class _SeqBlocks:
    salt: Hashable
    blocks: list[int] = field(default_factory=list)
    nodes: list[RadixNode] = field(default_factory=list)  # tree nodes of blocks[:len(nodes)]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False, collect_new_nodes: bool = False):
        self.num_blocks = num_blocks
        self.collect_new_nodes = collect_new_nodes
        self._new_nodes: list[RadixNode] = []
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tree = RadixTree(block_size, record_events)
        self._free: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _SeqBlocks] = {}

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return len(self._free) + self.tree.num_unreferenced

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def num_shared_blocks(self, seq_id: int) -> int:
        """Leading blocks of the sequence that come from the prefix cache (tree)."""
        return len(self._seqs[seq_id].nodes)

    def match(self, token_ids: Sequence[int], salt: Hashable = None) -> list[RadixNode]:
        """Cached leading blocks, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        return self.tree.match(token_ids, salt, max_blocks=(len(token_ids) - 1) // self.block_size)

    def num_cached_tokens(self, token_ids: Sequence[int], salt: Hashable = None) -> int:
        return len(self.match(token_ids, salt)) * self.block_size

    # -- allocation ----------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int,
                 salt: Hashable = None) -> bool:
        """Give a new sequence blocks for its first num_tokens tokens, reusing
        the cached prefix. False (and nothing changed) if the pool is short."""
        assert seq_id not in self._seqs
        nodes = self.match(token_ids, salt)
        num_needed = self.num_blocks_for(num_tokens) - len(nodes)
        reclaimed = sum(1 for n in nodes if n.ref_count == 0)  # no longer evictable once held
        if num_needed > self.num_free_blocks - reclaimed:
            return False
        self.tree.acquire(nodes)
        entry = self._seqs[seq_id] = _SeqBlocks(salt, [n.block_id for n in nodes], list(nodes))
        entry.blocks.extend(self._take(num_needed))
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the table cover num_tokens; False (nothing changed) if short."""
        entry = self._seqs[seq_id]
        num_needed = self.num_blocks_for(num_tokens) - len(entry.blocks)
        if num_needed > self.num_free_blocks:
            return False
        entry.blocks.extend(self._take(num_needed))
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the sequence's full blocks whose KV is computed."""
        if not self.enable_prefix_caching:
            return
        entry, bs = self._seqs[seq_id], self.block_size
        while (len(entry.nodes) + 1) * bs <= num_computed:
            i = len(entry.nodes)
            parent = entry.nodes[-1] if entry.nodes else self.tree.root(entry.salt)
            key = tuple(token_ids[i * bs:(i + 1) * bs])
            node = self.tree.child(parent, key)
            if node is None:
                node = self.tree.insert(parent, key, entry.blocks[i])
                if self.collect_new_nodes:
                    self._new_nodes.append(node)
            else:  # an equal block is cached already: use it, return ours
                self._free.append(entry.blocks[i])
                entry.blocks[i] = node.block_id
            self.tree.acquire([node])
            entry.nodes.append(node)

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """Give back the sequence's private blocks past its first num_blocks."""
        entry = self._seqs[seq_id]
        keep = max(num_blocks, len(entry.nodes))
        self._free.extend(entry.blocks[keep:])
        del entry.blocks[keep:]

    def nodes_of(self, seq_id: int) -> list[RadixNode]:
        """The tree nodes of the sequence's leading (committed) blocks."""
        return list(self._seqs[seq_id].nodes)

    def pop_new_nodes(self) -> list[RadixNode]:
        """Nodes inserted since the last call that are still in the tree."""
        new, self._new_nodes = self._new_nodes, []
        return [n for n in new if n.parent is not None and n.parent.children.get(n.key) is n]

    def pin(self, nodes: list[RadixNode]) -> list[RadixNode]:
        """Hold nodes and their ancestors (each once); unpin() the result."""
        held: dict[int, RadixNode] = {}
        for node in nodes:
            while node is not None and not node.is_root and id(node) not in held:
                held[id(node)] = node
                node = node.parent
        pinned = list(held.values())
        self.tree.acquire(pinned)
        return pinned

    def unpin(self, pinned: list[RadixNode]) -> None:
        self.tree.release(pinned)

    def free(self, seq_id: int) -> None:
        entry = self._seqs.pop(seq_id)
        self.tree.release(entry.nodes)
        self._free.extend(entry.blocks[len(entry.nodes):])

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block; return how many."""
        freed = self.tree.clear()
        self._free.extend(freed)
        return len(freed)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            self._free.extend(self.tree.evict(n - len(self._free)))
        return [self._free.popleft() for _ in range(n)]

    # -- integrity -----------------------------------------------------------
    def check_integrity(self, pinned: list[RadixNode] | None = None) -> None:
        """Assert the ownership and ref-count invariants of the module docstring;
        pinned: every node held by pin() now (each pin()'s list, concatenated)."""
        owner: dict[int, str] = {}

        def own(block: int, who: str) -> None:
            assert 0 <= block < self.num_blocks, f"block {block} out of range"
            assert block not in owner, f"block {block} owned by {owner[block]} and {who}"
            owner[block] = who

        for b in self._free:
            own(b, "free list")
        refs: dict[int, int] = {}
        for node in self.tree.nodes():
            own(node.block_id, "tree")
            refs[id(node)] = 0
            if not node.parent.is_root:
                assert node.parent.ref_count >= node.ref_count, "child referenced more than parent"
        for seq_id, entry in self._seqs.items():
            assert entry.blocks[:len(entry.nodes)] == [n.block_id for n in entry.nodes]
            for node in entry.nodes:
                refs[id(node)] += 1
            for b in entry.blocks[len(entry.nodes):]:
                own(b, f"sequence {seq_id}")
        for node in pinned or ():
            refs[id(node)] += 1
        assert len(owner) == self.num_blocks, f"{self.num_blocks - len(owner)} blocks leaked"
        nodes = list(self.tree.nodes())
        assert all(refs[id(n)] == n.ref_count for n in nodes), "ref_count != holders"
        assert self.tree.num_unreferenced == sum(n.ref_count == 0 for n in nodes)
        assert self.tree.evictable_leaf_ids() == {id(n) for n in nodes if n.is_evictable_leaf}
