"""Inter-process plumbing (floor 0: imports only the stdlib, zmq, msgspec).

    segments   named POSIX shared-memory segments: create (0600), attach, unlink, list
    shm_ring   BroadcastRing: one writer, N reader processes, fixed slots in one segment
    overflow   OverflowChannel: per-reader PUSH/PULL frames for messages bigger than a slot
    sockets    typed ZeroMQ PUSH/PULL/PUB/SUB wrappers (msgspec msgpack), ipc_address()
"""
