"""Named POSIX shared-memory segments, owned by one run.

Every segment a run creates is named ``deepserve-{run_id}-{purpose}`` so that
`list_segments` can find (and a supervisor can remove) whatever a crashed run
left behind. Segments are created owner-only (mode 0600) and zero-filled.

The resource tracker: on Python < 3.13, `SharedMemory` registers every
segment with `multiprocessing.resource_tracker`, even when it only attaches.
The tracker then unlinks the segment (and warns about "leaked shared_memory
objects") when the process exits, which would destroy a segment the creator
still uses. We unlink explicitly, so both `attach_segment` and (by default)
`create_segment` take the segment back out of the tracker, and
`unlink_segment` unlinks by name without telling the tracker.

Squats: names derive from run ids that others can predict, so a name may be
taken before we create it (a local process, or a leftover we may not unlink).
`free_run_id` extends a run id with a random suffix when anything already
lives under it, and unlinking is cleanup: a segment we may not unlink is
logged and left, never an exception that stops a restart.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import _posixshmem  # the stdlib's own POSIX shm binding (used by SharedMemory)

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
MAX_NAME_LEN = 200
_HAS_TRACK_ARG = sys.version_info >= (3, 13)


def segment_name(run_id: str, purpose: str) -> str:
    """The shared-memory name for `purpose` in run `run_id` (no leading slash)."""
    name = f"deepserve-{run_id}-{purpose}"
    check_segment_name(name)
    return name


def free_run_id(run_id: str) -> str:
    """`run_id` when no segment is named under it yet; else `run_id` plus a
    random suffix (still starting with run_id, so a sweep by its prefix finds
    what it creates). The taken names are left alone: we did not create them."""
    taken = list_segments(segment_name(run_id, ""))
    if not taken:
        return run_id
    fresh = f"{run_id}r{uuid.uuid4().hex[:6]}"
    log.warning("shared-memory names of run %s are taken (%s); using run id %s",
                run_id, ", ".join(taken[:4]), fresh)
    return fresh


def create_segment(name: str, size: int, track: bool = False) -> SharedMemory:
    """Create a new zero-filled, owner-only segment of `size` bytes.

    Raises FileExistsError if the name is taken. With `track=False` (the
    default) the resource tracker forgets the segment: the caller unlinks it
    with `unlink_segment`. With `track=True` the tracker unlinks it at exit
    if nobody did; such a segment must be removed with `shm.unlink()`.
    """
    check_segment_name(name)
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    shm = _open(name, create=True, size=size, track=track)
    try:
        fd = shm._fd  # SharedMemory exposes no public fd; POSIX only
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        shm.close()
        unlink_segment(name)
        raise
    return shm


def attach_segment(name: str) -> SharedMemory:
    """Attach to an existing segment; the resource tracker never owns it.

    Raises FileNotFoundError if no segment has that name.
    """
    check_segment_name(name)
    return _open(name, create=False, size=0, track=False)


def unlink_segment(name: str) -> bool:
    """Remove the segment's name; attached mappings stay valid. Gone is fine.
    Cleanup never raises: a segment we may not unlink (PermissionError, e.g.
    another user's squat) is logged and left; False then."""
    check_segment_name(name)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot unlink shared memory %s: %s (left in place)", name, exc)
        return False
    return True


def list_segments(prefix: str) -> list[str]:
    """Names of the segments under /dev/shm that start with `prefix`, sorted."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def _open(name: str, create: bool, size: int, track: bool) -> SharedMemory:
    if _HAS_TRACK_ARG:
        return SharedMemory(name, create=create, size=size, track=track)
    shm = SharedMemory(name, create=create, size=size)
    if not track:
        # 3.11/3.12 registered it in __init__; take it back out so the tracker
        # neither unlinks it nor warns when this process exits.
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def check_segment_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or len(name) > MAX_NAME_LEN:
        raise ValueError(f"invalid shared-memory name {name!r}: need 1..{MAX_NAME_LEN} "
                         "characters, no '/' or NUL")
