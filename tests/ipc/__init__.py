"""Tests of deepserve.ipc: segments, the shared-memory ring, typed sockets."""
