"""Parked requests: the ones no TE can take yet, each until its deadline.

    JE._dispatch ──NoTEAvailable──> park(msg, ids, until) ──> ParkingLot (oldest first)
    JE.step      ──unpark()──> dispatch(msg, ids, until) again (a TE list came, or
                                its deadline passed: the JE's dispatch fails it)
    JE.step      ──demand()──> ModelDemand (the parked requests' models) ──> CM

A request waits here while the JE has no complete TE list (it or the CM just
restarted), while every TE of its kind restarts, or while the autoscaler
starts a TE of its model. At most PARK_MAX wait; one more is not parked.
"""

from __future__ import annotations

from typing import Callable

from deepserve.control.je.model_book import ModelBook
from deepserve.messages.engine import SubmitRequest
from deepserve.messages.scaling import ModelDemand

PARK_MAX = 4096

Dispatch = Callable[[SubmitRequest, list[int], float], bool]
"""(msg, ids, park_until) -> False when it parked the request (again)."""


class ParkingLot:
    """book: the JE's models (their names, and the demand it tells the CM);
    dispatch: the JE's route-and-send, which parks here again or fails the
    request once its deadline passed."""

    def __init__(self, book: ModelBook, dispatch: Dispatch, max_parked: int = PARK_MAX):
        self.book, self.dispatch, self.max_parked = book, dispatch, max_parked
        self.parked: list[tuple[float, SubmitRequest, list[int]]] = []  # oldest first

    def __len__(self) -> int:
        return len(self.parked)

    def park(self, msg: SubmitRequest, ids: list[int], park_until: float, now: float) -> bool:
        """Hold the request until park_until; False: past it, or the lot is full."""
        if now >= park_until or len(self.parked) >= self.max_parked:
            return False
        self.parked.append((park_until, msg, ids))
        return True

    def unpark(self) -> None:
        """Dispatch the parked requests again, oldest first: routed once a TE
        can take them, failed past their deadline, else parked again."""
        parked, self.parked = self.parked, []
        for park_until, msg, ids in parked:
            self.dispatch(msg, ids, park_until)

    def drop(self, request_id: str) -> None:
        """An aborted request leaves the lot."""
        self.parked = [p for p in self.parked if p[1].request_id != request_id]

    def demand(self) -> ModelDemand | None:
        """What the autoscaler should hear now (model_book.py), parked requests
        counted under their model."""
        return self.book.demand(self.book.name_of(p[1].model) for p in self.parked)
