"""Head terms: one head at a time, even when two are alive.

    head node starts ──claim(1)────────────> term T: 1, or past the highest recorded
    standby takes over ──claim(heard + 1)──> term T' > every term it heard
    the CM publishes its term in every TEList ──> every node, JE and gateway keeps the
        highest term it heard (messages/control.py TermFence) and ignores lists below it
    every node's NodeReport carries that term ──> a CM whose own is lower was deposed:
        it steps down (head_stepped_down) and its node stops its CM and JE

Where the heads share storage (`[cluster] state_dir`), each term is claimed by
creating `state_dir/terms/T` exclusively (O_EXCL): of two standbys that
take over at once one gets T, and the other does not take over. Without a
state_dir the terms live in the messages only: a standby takes the term past
the one it heard, and a head that comes back (a restart) starts at 1 and is
deposed by the first NodeReport it gets from a node that heard a higher term.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
TERMS = "terms"


class HeadTerms:
    """state_dir: the heads' shared directory, "" for none; me: what a claim
    file says about its claimant (host:port)."""

    def __init__(self, state_dir: str, me: str):
        self.dir = Path(state_dir) / TERMS if state_dir else None
        self.me = me

    def highest_recorded(self) -> int:
        """The highest term claimed in state_dir (0: none, or no state_dir)."""
        if self.dir is None or not self.dir.is_dir():
            return 0
        return max((int(p.name) for p in self.dir.iterdir() if p.name.isdigit()), default=0)

    def claim(self, at_least: int, tries: int = 1) -> int | None:
        """A term >= at_least and past every recorded one, now this node's; None
        when another claimed each of the `tries` terms tried first."""
        term = max(at_least, self.highest_recorded() + 1)
        if self.dir is None:
            return term
        self.dir.mkdir(parents=True, exist_ok=True)
        for t in range(term, term + tries):
            try:
                fd = os.open(self.dir / str(t), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                log.warning("head term %d: already claimed (%s)", t, self.dir / str(t))
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.me + "\n")
            return t
        return None
