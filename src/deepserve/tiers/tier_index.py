"""TierIndex: the node tier service's bookkeeping for one model key (pure, no I/O).

Host slots (the pool in shared memory), each in exactly one state:

    FREE ──reserve──> WRITING (a lease) ──commit──> VALID (LRU) ──evict / unpin──> FREE
      ^                   │ lease released / expired                    │
      └───────────────────┘<────────────────────────────────────────────┘

Disk entries: hash -> file bytes, LRU, within `disk_budget` bytes; the
server writes a file for every committed slot not on disk yet (the slot is
read-pinned meanwhile) and deletes the files `disk_written` evicts.

Pins, four kinds, none of which evicts:
  readers   a lookup lease (a TE is copying the block up) or a disk write
            in progress: the slot / file must stay as it is;
  contexts  a context id pins its blocks until it expires or is unpinned:
            a pinned host slot may be evicted only once the block is on
            disk (it moves down a tier), a pinned file never; the pinned
            blocks of one model key fit within `pin_budget` bytes, else the
            reserve that asks for more fails ("over_budget");
  leases    expire `lease_s` after they were given (a TE that died
            releases nothing), their pins with them;
  host      a turn that ended in tool calls holds its blocks in host slots
            until it expires, on disk or not, then leaves them in the LRU
            (host_pins.py: at most half the slots).

A held commit (DualPath's decode-path staging: the blocks stay read-pinned
until the prefill TE loaded them) is held only while at most half the slots
are read-pinned, so that the write-through keeps room. A staging reserve
(hold=True) therefore gets slots only for as many leading blocks as that
half still has room for, counting the holds reserved and not committed yet:
a block staged past it would be committed unpinned, evicted by the next
writes before its prefill TE loads it, and read from storage twice
(`holds_cut` counts the blocks refused so).

check_integrity() asserts every invariant above.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from deepserve.messages.cache import NO_SLOT, ON_DISK
from deepserve.tiers.host_pins import HostPins

FREE, WRITING, VALID = 0, 1, 2
_lease_ids = itertools.count(1)


@dataclass
class Lease:
    expires_at: float
    slots: list[int] = field(default_factory=list)  # read-pinned host slots
    disk: list[int] = field(default_factory=list)  # read-pinned disk hashes
    writing: set[int] = field(default_factory=set)  # reserved slots
    hold: bool = False  # reserved for a staging that will hold what it writes


class TierIndex:
    def __init__(self, num_slots: int, block_bytes: int, disk_budget: int = 0,
                 pin_budget: int | None = None, lease_s: float = 30.0):
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.disk_budget = disk_budget
        self.disk_enabled = disk_budget > 0
        self.pin_budget = pin_budget if pin_budget is not None else \
            (num_slots * block_bytes if not self.disk_enabled else disk_budget) // 2
        self.lease_s = lease_s
        self.hash_of: list[int | None] = [None] * num_slots
        self.state = [FREE] * num_slots
        self.readers = [0] * num_slots
        self.slot_of: dict[int, int] = {}  # hash -> slot (WRITING or VALID)
        self.free: deque[int] = deque(range(num_slots))
        self.holds_cut = 0  # staging blocks refused a slot: the held half was full
        self.lru: OrderedDict[int, None] = OrderedDict()  # VALID hashes, oldest first
        self.disk: OrderedDict[int, int] = OrderedDict()  # hash -> bytes, oldest first
        self.disk_bytes = 0
        self.disk_readers: Counter[int] = Counter()
        self.leases: dict[int, Lease] = {}
        self.pins: dict[int, set[str]] = {}  # hash -> context ids
        self.contexts: dict[str, tuple[list[int], float]] = {}  # id -> (hashes, expires_at)
        self.doomed: set[int] = set()  # unpinned while busy (read, or on its way to disk)
        self.reaped: list[int] = []  # files release() freed: the server deletes them
        self.host_pins = HostPins(num_slots // 2)

    # -- queries -------------------------------------------------------------------
    @property
    def num_valid(self) -> int:
        return len(self.lru)

    @property
    def host_bytes(self) -> int:
        return len(self.slot_of) * self.block_bytes

    @property
    def pinned_bytes(self) -> int:
        return len(self.pins) * self.block_bytes

    def is_on_disk(self, h: int) -> bool:
        return self.disk_enabled and h in self.disk

    # -- lookups -------------------------------------------------------------------
    def lookup(self, hashes: list[int], now: float, count: bool = True
               ) -> tuple[int, list[int]]:
        """(lease id, slot or ON_DISK per leading hash held); 0: nothing held.
        count: its hits on host pins are counted (not a pin's own lookup)."""
        out: list[int] = []
        lease = Lease(now + self.lease_s)
        for h in hashes:
            slot = self.slot_of.get(h)
            if slot is not None and self.state[slot] == VALID:
                if count:
                    self.host_pins.hit(h)
                self.readers[slot] += 1
                self.lru.move_to_end(h)
                lease.slots.append(slot)
                out.append(slot)
            elif self.is_on_disk(h):
                self.disk_readers[h] += 1
                self.disk.move_to_end(h)
                lease.disk.append(h)
                out.append(ON_DISK)
            else:
                break
        if not out:
            return 0, []
        return self._add_lease(lease), out

    def release(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        for slot in lease.slots:
            self.readers[slot] -= 1
        for h in lease.disk:
            self._unread_disk(h)
        for slot in lease.writing:  # reserved, never committed
            self._free_slot(slot)
        self.reaped += self._reap([self.hash_of[s] for s in lease.slots] + lease.disk)

    # -- writes --------------------------------------------------------------------
    def reserve(self, hashes: list[int], now: float, context_id: str | None = None,
                expires_at: float = 0.0, hold: bool = False, on_host: bool = False
                ) -> tuple[int, list[int], str | None]:
        """(lease id, slot to write or NO_SLOT per hash, error). A context's
        hashes are pinned whether or not they need writing (on_host: a host
        pin). hold: for a staging that will hold its blocks: no more new
        slots than the held half has room for (module doc)."""
        pin = self.host_pins.pin if on_host else self.pin
        if context_id is not None and not pin(context_id, hashes, expires_at):
            return 0, [], "over_budget"
        lease = Lease(now + self.lease_s, hold=hold)
        room = self._hold_room() if hold else len(hashes)
        out = []
        for h in hashes:
            if h in self.slot_of:
                if self.state[self.slot_of[h]] == VALID:
                    self.lru.move_to_end(h)
                out.append(NO_SLOT)
                continue
            if len(lease.writing) >= room:
                self.holds_cut += 1
                out.append(NO_SLOT)
                continue
            slot = self._alloc()
            if slot is None:
                out.append(NO_SLOT)
                continue
            self.state[slot], self.hash_of[slot] = WRITING, h
            self.slot_of[h] = slot
            lease.writing.add(slot)
            out.append(slot)
        if not lease.writing:
            return 0, out, None
        return self._add_lease(lease), out, None

    def commit(self, lease_id: int, written: list[int],
               hold: bool = False) -> list[tuple[int, int]]:
        """The lease's `written` slots are VALID; its other reserved slots go
        back. Returns (slot, hash) to copy to disk, each read-pinned until
        disk_written. hold: the lease lives on (same id, same expiry) as a
        read pin of the written slots, until released; only while at most
        half the slots would be read-pinned (the write-through needs room)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return []
        if hold:
            hold = self._num_read_pinned() + len(written) <= self.num_slots // 2
        to_disk, held = [], Lease(lease.expires_at)
        for slot in written:
            if slot not in lease.writing:
                continue  # not this lease's (a forged or late commit)
            lease.writing.discard(slot)
            h = self.hash_of[slot]
            self.state[slot] = VALID
            self.lru[h] = None
            if self.disk_enabled and h not in self.disk:
                self.readers[slot] += 1
                to_disk.append((slot, h))
            if hold:
                self.readers[slot] += 1
                held.slots.append(slot)
        for slot in lease.slots:
            self.readers[slot] -= 1
        for h in lease.disk:
            self._unread_disk(h)
        for slot in lease.writing:
            self._free_slot(slot)
        self.reaped += self._reap([self.hash_of[s] for s in lease.slots] + lease.disk)
        if held.slots:
            self.leases[lease_id] = held
        return to_disk

    def disk_written(self, slot: int, h: int, nbytes: int, ok: bool) -> list[int]:
        """A disk write of slot (block h) ended; the hashes whose files to delete."""
        self.readers[slot] -= 1
        if h in self.doomed:  # its context went meanwhile: the new file goes too
            return ([h] if ok else []) + self._reap([h])
        if not ok or not self.disk_enabled:
            return []
        if h in self.disk:
            self.disk_bytes -= self.disk[h]
        self.disk[h] = nbytes
        self.disk_bytes += nbytes
        return self.evict_disk()

    def add_disk(self, h: int, nbytes: int) -> None:
        """A file found on disk at start (scan_blocks), oldest first."""
        if self.disk_enabled and h not in self.disk:
            self.disk[h] = nbytes
            self.disk_bytes += nbytes

    def disable_disk(self) -> list[int]:
        """The disk failed (full): no more disk entries; those to forget."""
        self.disk_enabled = False
        gone = list(self.disk)
        self.disk.clear()
        self.disk_bytes = 0
        return gone

    def enable_disk(self) -> None:
        """The disk takes writes again: entries come back through add_disk."""
        self.disk_enabled = self.disk_budget > 0

    def drop_disk(self, hashes: list[int]) -> list[int]:
        """Forget these disk entries (bad files); the files to delete."""
        gone = []
        for h in hashes:
            if h in self.disk:
                self.disk_bytes -= self.disk.pop(h)
                gone.append(h)
        return gone

    # -- contexts ------------------------------------------------------------------
    def pin(self, context_id: str, hashes: list[int], expires_at: float) -> bool:
        new = {h for h in hashes if h not in self.pins}
        old = self.contexts.get(context_id)
        if (len(self.pins) + len(new)) * self.block_bytes > self.pin_budget:
            return False
        for h in hashes:
            self.pins.setdefault(h, set()).add(context_id)
            self.doomed.discard(h)
        kept = old[0] if old else []
        self.contexts[context_id] = (list(dict.fromkeys(kept + list(hashes))), expires_at)
        return True

    def unpin(self, context_id: str) -> list[int]:
        """Free every block only this context pinned, on every tier; the disk
        files to delete. A host pin of that id ends (its blocks stay cached)."""
        self.host_pins.unpin(context_id)
        entry = self.contexts.pop(context_id, None)
        if entry is None:
            return []
        files = []
        for h in entry[0]:
            holders = self.pins.get(h)
            if holders is None:
                continue
            holders.discard(context_id)
            if holders:
                continue
            del self.pins[h]
            self.doomed.add(h)
            files += self._reap([h])
        return files

    def _reap(self, hashes) -> list[int]:
        """Free what is left of doomed blocks once nobody reads them; the files to delete."""
        files = []
        for h in hashes:
            if h not in self.doomed:
                continue
            slot = self.slot_of.get(h)
            if slot is not None and self.state[slot] == VALID and self.readers[slot] == 0:
                del self.lru[h]
                self._free_slot(slot)
                slot = None
            if h in self.disk and not self.disk_readers[h]:
                self.disk_bytes -= self.disk.pop(h)
                files.append(h)
            if slot is None and h not in self.disk:
                self.doomed.discard(h)
        return files

    def expire(self, now: float, wall_now: float) -> list[int]:
        """Release lapsed leases, unpin expired contexts; the files to delete."""
        for lease_id in [i for i, lease in self.leases.items() if lease.expires_at <= now]:
            self.release(lease_id)
        files, self.reaped = self.reaped, []
        self.host_pins.expire(wall_now)
        for context_id in [c for c, (_, at) in self.contexts.items() if at <= wall_now]:
            files += self.unpin(context_id)
        return files

    # -- internals -------------------------------------------------------------------
    def _hold_room(self) -> int:
        """Slots a held commit could still take: half the pool, less the slots
        read-pinned and the staging slots reserved and not committed yet."""
        pending = sum(len(lease.writing) for lease in self.leases.values() if lease.hold)
        return max(0, self.num_slots // 2 - self._num_read_pinned() - pending)

    def _num_read_pinned(self) -> int:
        return sum(1 for r in self.readers if r)

    def _add_lease(self, lease: Lease) -> int:
        lease_id = next(_lease_ids)
        self.leases[lease_id] = lease
        return lease_id

    def _alloc(self) -> int | None:
        if self.free:
            return self.free.popleft()
        for _ in range(len(self.lru)):  # oldest first; unevictable ones move back
            h = next(iter(self.lru))
            slot = self.slot_of[h]
            if self.readers[slot] == 0 and not self.host_pins.holds(h) \
                    and (h not in self.pins or self.is_on_disk(h)):
                del self.lru[h]
                self._free_slot(slot)
                return self.free.popleft()
            self.lru.move_to_end(h)
        return None

    def _free_slot(self, slot: int) -> None:
        h = self.hash_of[slot]
        if h is not None and self.slot_of.get(h) == slot:
            del self.slot_of[h]
        self.hash_of[slot], self.state[slot] = None, FREE
        self.free.append(slot)

    def _unread_disk(self, h: int) -> None:
        self.disk_readers[h] -= 1
        if self.disk_readers[h] <= 0:
            del self.disk_readers[h]

    def evict_disk(self) -> list[int]:
        gone = []
        for h in list(self.disk):
            if self.disk_bytes <= self.disk_budget:
                break
            if h in self.pins or self.disk_readers[h]:
                continue
            self.disk_bytes -= self.disk.pop(h)
            gone.append(h)
        return gone

    def check_integrity(self) -> None:
        reads, writing = Counter(), set()
        for lease in self.leases.values():
            reads.update(lease.slots)
            assert not writing & lease.writing, "a slot reserved by two leases"
            writing |= lease.writing
        assert len(self.free) + len(self.slot_of) == self.num_slots, "slots leaked"
        for slot in range(self.num_slots):
            h, state = self.hash_of[slot], self.state[slot]
            if state == FREE:
                assert h is None and slot in self.free
            else:
                assert self.slot_of[h] == slot
                assert (state == WRITING) == (slot in writing)
                assert (state == VALID) == (h in self.lru)
            assert self.readers[slot] >= reads[slot] >= 0, f"slot {slot} readers"
        assert self.disk_bytes == sum(self.disk.values())
        pinned = {h for hashes, _ in self.contexts.values() for h in hashes}
        assert pinned >= set(self.pins), "a pin without its context"
        for h, holders in self.pins.items():
            assert holders and all(h in self.contexts[c][0] for c in holders)
        assert not self.doomed & set(self.pins), "a pinned block is doomed"
        self.host_pins.check_integrity()
