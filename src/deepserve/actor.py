"""The life every DeepServe process follows.

    set log prefix -> install signal handlers (they only set a flag) -> build
    state -> report ready -> loop until the flag is set or the parent is gone
    -> in `finally`, release in reverse order.

The parent holds the write end of a *death pipe* and never writes to it; when
the parent dies the pipe reaches EOF, which `ActorLife.should_stop()` notices,
so no child outlives its parent. Parents notice dead children through the
processes' sentinels (see engine/launcher.py).
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection


class ActorLife:
    """death_pipe: for children started by multiprocessing; parent_pid: for
    children started as commands (they stop once reparented)."""

    def __init__(self, name: str, death_pipe: Connection | None = None,
                 parent_pid: int | None = None):
        self.name = name
        self._death_pipe = death_pipe
        self._parent_pid = parent_pid
        self._stop_requested = False
        logging.basicConfig(level=os.environ.get("DEEPSERVE_LOG_LEVEL", "WARNING"),
                            format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._stop_requested = True  # only a flag: the loop decides when to stop

    def request_stop(self) -> None:
        self._stop_requested = True

    @property
    def is_parent_alive(self) -> bool:
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            return False
        if self._death_pipe is None:
            return True
        try:
            return not self._death_pipe.poll(0)  # readable only at EOF
        except (OSError, EOFError):
            return False

    def should_stop(self) -> bool:
        return self._stop_requested or not self.is_parent_alive
