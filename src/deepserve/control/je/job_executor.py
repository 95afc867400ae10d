"""Job executor: request -> job -> task(s), routed to a TE, tracked to its end.

    gateways ──SubmitRequest/AbortRequest──> [inbox PULL]
                                                 │ tokenize (admission.py), route (routing/router.py)
                                                 ▼
                              TE tokenizer inboxes (te_links.py: a timeout per put)
    CM ──TEList / TEReport (SUB)──> router: TE set, loads, cached blocks, finished tasks
    JE ──RequestFailed──> the request's reply_to (no TE, bad input, its TE went down)

A chat or completion request is a job of one `colocated` task, or, when the
PD policy (control/je/routing/pd_policy.py: DeepServe Algorithm 1, step 1) says the
request's shape is served better disaggregated, of a `prefill` and a
`decode` task: the decode TE gets the request with prefill_from = the chosen
prefill TE and orders the KV from it itself (messages/pd.py). Either way the
output streams from one TE straight to the gateway; the JE only learns that
the job ended (TEReport.finished of that TE), or that one of its TEs left
the list, which fails it (and aborts the other task).

Parked (parking.py): a request that finds no TE to take it (no complete TE
list yet: the JE or the CM just restarted; or every TE of its kind is
restarting) waits up to PARK_S, routed as soon as a TE list allows, instead
of being refused. A request for a scalable model with no TE waits up to
[scaling] queue_timeout_s while the autoscaler starts one: the JE tells the
cluster manager what arrived and what is held (ModelDemand, model_book.py).

Tenants (fair_share.py): a TE is sent at most its max_num_seqs requests;
the rest wait in a fair queue per model and go out in weighted fair order
(fair_queue.py) as the TEs' tokenizers say requests ended (TaskDone, to
done_to: this JE's inbox); a tenant at its share of the slots leaves one
free for each other tenant heard from lately. A tenant past its [tenants]
limits is refused (rate_limited: the gateway's 429).

Many models (model_book.py): a request is routed only to its model's TEs;
a TE draining for scale-in gets nothing new and finishes what it has.

Requests of death (control/je/suspects.py has the rules and the trade-off):
a request in flight on a TE that leaves the list is a suspect; its first
crash is te_lost (resumed by the gateway; with [router] isolate_suspects run
isolated: isolation.py), the second request_crashed_engine (final;
`request_quarantined` logged; the id refused from then on).

`python -m deepserve.control.je.job_executor --conf RUN_DIR/node.json --role
job-executor`: its sockets are the run's, [router] and [node] model /
max_attempts come from the resolved config (load_settings).
"""

from __future__ import annotations

import logging
import time

import msgspec.structs
import zmq

from deepserve.actor import run_main
from deepserve.control.identity import je_admit
from deepserve.control.je.context_jobs import ContextJobs
from deepserve.control.je.fair_share import FairShare, num_tokens, tenant_of
from deepserve.control.je.contexts import ContextBook
from deepserve.control.je.isolation import Isolation
from deepserve.control.je.je_settings import PARK_S, JESettings, load_settings
from deepserve.control.je.model_book import ModelBook
from deepserve.control.je.parking import ParkingLot
from deepserve.control.je.suspects import SuspectBook
from deepserve.control.je.tasks import CRASHED, EventSink, Task, crashed_text, no_event
from deepserve.control.je.te_links import TELinks
from deepserve.control.je.turns import TurnBook, request_ids
from deepserve.control.je.routing.dualpath import DualPathScheduler, engine_loads
from deepserve.control.je.routing.pd_policy import PDPolicy, pd_policy_of
from deepserve.control.je.routing.router import NoTEAvailable, PromptHashes, Router
from deepserve.errors import InvalidRequestError
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, SubSocket, endpoints
from deepserve.messages.control import FromClusterManager, TEList, TEReport
from deepserve.messages.cache import ContextUnpin
from deepserve.messages.contexts import (CreateContext, DeleteContext, GetContext, PinTurn,
                                         TurnDone)
from deepserve.messages.engine import (AbortRequest, RequestDelta, RequestFailed, SubmitRequest,
                                       TaskDone)
from deepserve.messages.scaling import RequestLatencies

log = logging.getLogger(__name__)
_IN = (SubmitRequest | AbortRequest | RequestLatencies | CreateContext | GetContext
       | DeleteContext | TurnDone | PinTurn | RequestDelta | RequestFailed | TaskDone)


class JobExecutor:
    """settings: the JE's part of the node's config (je_settings.py); events:
    health events (request_migrated, ...) to the supervisor. Its router, PD
    policy and DualPath scheduler are built from settings.router; a test may
    hand in a PD policy of its own (pd_policy)."""

    def __init__(self, ctx: zmq.Context, settings: JESettings, events: EventSink = no_event,
                 *, pd_policy: PDPolicy | None = None):
        s, r = settings, settings.router
        # the policies first: a bad [router] file fails before a socket is bound
        self.router = Router(r.policy, **({} if r.balance_threshold is None
                                          else {"balance_threshold": r.balance_threshold}))
        self.pd_policy = pd_policy if pd_policy is not None else pd_policy_of(r)
        self.dualpath = (None if r.dualpath is None  # pairs and read paths (routing/dualpath.py)
                         else DualPathScheduler(**msgspec.structs.asdict(r.dualpath)))
        self.ctx = ctx
        self.inbox = PullSocket(ctx, s.inbox, bind=True, type=_IN, admit=je_admit)
        self.inbox_address = endpoints(s.inbox)[0]  # done_to of every task (TaskDone): the
        # one this JE binds (with standby heads, s.inbox lists every head's)
        self.share = FairShare(s.tenants)  # tenants' limits, TE slots, fair queues
        self.cm = SubSocket(ctx, s.cm_pub, bind=False, type=FromClusterManager)
        self.book = ModelBook(s.models, s.scalable)  # tokenizers, TEs and demand per model
        self.cm_inbox, self.queue_timeout_s = s.cm or None, s.queue_timeout_s  # ModelDemand
        self.max_attempts = s.max_attempts  # a request runs on at most this many TEs
        self.events = events  # health events (request_migrated) to the supervisor
        self.num_migrated = 0
        self.links = TELinks(ctx)  # the listed TEs and sends to them
        self.replies = Outboxes(ctx, lists=(s.cm,))  # reply_to, and every head's CM: short
        self.tasks: dict[str, Task] = {}
        self.suspects = SuspectBook()
        self.isolate_suspects = r.isolate_suspects  # [router] isolate_suspects: isolation
        self.isolation = Isolation(self.suspects, lambda: self.router.tes, self._job_layout,
                                   self._route, self._send_task, self._note_migrated, self._fail)
        self.parking = ParkingLot(self.book, self._dispatch)  # _dispatch parks here
        self.kv_cache = s.kv_cache  # the tier service: ContextUnpin
        self.turns = TurnBook(s.continuity)  # token-id continuity (turns.py)
        self.contexts = ContextJobs(ContextBook(s.contexts_path or None), self.book,
                                    self.inbox_address,
                                    lambda m, ids: self._dispatch(m, ids, time.monotonic() + PARK_S),
                                    self._reply, self._unpin, turn_pin_s=s.turn_pin_s)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.cm.socket, zmq.POLLIN)

    @property
    def te_sockets(self) -> dict[str, str]:
        """The listed TEs' inboxes (te id -> address)."""
        return self.links.addresses

    def step(self, timeout_ms: int = 200) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self.cm.socket in events:
            for msg in self.cm.drain():
                self._on_cm(msg)
        if self.inbox.socket in events:
            for msg in self.inbox.drain():
                self._on_inbox(msg)
        self.contexts.step()
        if self.share:
            self.share.release(lambda m, ids, until, queued_s:
                               self._send(m, ids, until, queued_s) is not None)
        if self.parking:
            self.parking.unpark()
        if self.isolation:
            self.isolation.release(self.tasks.values())
        if self.cm_inbox is not None:
            demand = self.parking.demand()
            if demand is not None:
                self.replies.put(self.cm_inbox, demand)

    # -- requests ----------------------------------------------------------------
    def _on_inbox(self, msg) -> None:
        if isinstance(msg, SubmitRequest):
            self._submit(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg)
        elif isinstance(msg, RequestLatencies):
            self.book.add_latencies(msg.samples)
        elif isinstance(msg, (RequestDelta, RequestFailed)):
            self.contexts.on_reply(msg)  # of a context's prefill (reply_to is this JE)
        elif isinstance(msg, TurnDone):
            self.turns.on_done(msg.request_id, msg.output_ids)
        elif isinstance(msg, TaskDone):
            task = self.tasks.get(msg.request_id)
            if task is not None and task.attempt == msg.attempt:
                self._end_task(msg.request_id)
                self.suspects.forget(msg.request_id)  # it completed: not poison
        else:
            {CreateContext: self.contexts.create, GetContext: self.contexts.get,
             DeleteContext: self.contexts.delete, PinTurn: lambda m: self.contexts.turn_pins.pin(
                 self.turns.ended(m.request_id))}[type(msg)](msg)

    def _unpin(self, context_id: str) -> None:
        if self.kv_cache:
            self.replies.put(self.kv_cache, ContextUnpin(context_id=context_id))

    def _submit(self, msg: SubmitRequest) -> None:
        if self.suspects.is_quarantined(msg.request_id):
            return self._fail(msg, CRASHED, crashed_text(self.suspects.crashes(msg.request_id)))
        if msg.attempt >= self.max_attempts:
            return self._fail(msg, "engine_dead", f"the request's TE failed {msg.attempt} times; "
                              f"giving up after {self.max_attempts} attempts")
        try:
            model = self.book.name_of(msg.model)
            ids = request_ids(msg, model, self.book, self.contexts.book, self.turns)
        except InvalidRequestError as e:
            return self._fail(msg, e.code, str(e), e.param)
        refused = self.share.admit(msg, num_tokens(msg, ids, self.book.prompts(model).max_len))
        if refused is not None:
            return self._reply(msg.reply_to, refused)
        if msg.attempt == 0:
            self.book.note_arrival(model)
        if self.isolate_suspects and self.suspects.is_suspect(msg.request_id):
            return self.isolation.hold(msg, ids, self.tasks.values())
        waits = self.book.waits_for_scaling(model) or self.dualpath is not None  # for room
        wait_s = self.queue_timeout_s if waits else PARK_S
        self._dispatch(msg, ids, time.monotonic() + wait_s)

    def _dispatch(self, msg: SubmitRequest, ids: list[int], park_until: float) -> bool:
        """Route and send the job; while every TE of its model is full (or
        others wait), wait in its fair queue; with no TE, park it until
        park_until. False: it waits."""
        model = self.book.name_of(msg.model)
        sent = None if self.share.has_waiting(model) else self._send(msg, ids, park_until)
        if sent is None:
            self.share.wait(model, msg, ids, park_until)
            return False
        return sent

    def _send(self, msg: SubmitRequest, ids: list[int], park_until: float,
              queued_s: float = 0.0) -> bool | None:
        """Route among the TEs with a free slot and send; True: sent (or
        failed for good), False: parked, None: its model's TEs are full."""
        full = self.share.full_tes(tenant_of(msg))
        try:
            if not self.links.has_list:
                raise NoTEAvailable("no TE list from the cluster manager yet")
            te_id, prefill_te, path = self._route(ids, msg.salt, msg.model, exclude=full,
                                                  max_tokens=msg.sampling.max_tokens,
                                                  request_id=msg.request_id)
        except NoTEAvailable as e:
            te_model = self.book.te_model(self.book.name_of(msg.model))
            if full and self.share.is_saturated(full, self.router.tes.values(), te_model):
                return None
            if self.parking.park(msg, ids, park_until, time.monotonic()):
                return False
            model = self.book.name_of(msg.model)
            why = (f"no engine of model {model!r} came up within {self.queue_timeout_s:g} s"
                   if self.book.waits_for_scaling(model) else f"no TE can take the request: {e}")
            self._fail(msg, "engine_dead", why)
            return True
        if self._send_task(msg, ids, te_id, prefill_te, read_path=path,
                           queued_s=queued_s) and msg.attempt:
            self._note_migrated(msg, te_id, len(ids))
        return True

    def _route(self, ids: list[int], salt: str | None, model: str | None,
               exclude: frozenset[str] = frozenset(), max_tokens: int | None = None,
               request_id: str = "") -> tuple[str, str | None, str | None]:
        """(TE, prefill TE or None, read path or None) for a job of `model`,
        never on a TE in `exclude`; with [router] dualpath, DualPath's
        scheduler picks the pair and the side that reads storage (at debug
        level each choice and what it compared goes to the health log)."""
        te_model = self.book.te_model(self.book.name_of(model))  # None: every TE serves it
        if self._job_layout(ids, exclude, max_tokens, te_model) != "disaggregated":
            return self.router.route(ids, salt, exclude=exclude, model=te_model), None, None
        if self.dualpath is not None:
            d = self.dualpath.choose(len(ids), max_tokens or 0, *(
                engine_loads(self.router.candidates(t, te_model, exclude), self.router.reports, t)
                for t in ("prefill", "decode")))
            if d is None:
                raise NoTEAvailable("every prefill TE is past beta or no decode TE has room")
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: %s", request_id, d.reason)
                self.events("dualpath_decision", request_id=request_id, **d.details())
            return d.decode_te, d.prefill_te, d.read_path
        hashes = PromptHashes(ids, salt)  # hashed once for both decisions
        prefill_te = self.router.route(ids, salt, "prefill", exclude, te_model, hashes)
        return self.router.route(ids, salt, "decode", exclude, te_model, hashes), prefill_te, None

    def _send_task(self, msg: SubmitRequest, ids: list[int], te_id: str, prefill_te: str | None,
                   is_suspect: bool = False, read_path: str | None = None,
                   queued_s: float = 0.0) -> bool:
        """Send the task; a TE that does not take it in time fails it (retryable)."""
        prefill_from = self.links.addresses[prefill_te] if prefill_te is not None else None
        task = SubmitRequest(request_id=msg.request_id, prompt_token_ids=ids,
                             sampling=msg.sampling, salt=msg.salt, reply_to=msg.reply_to,
                             prefill_from=prefill_from, attempt=msg.attempt,
                             resumed_output_ids=msg.resumed_output_ids,
                             resumed_text_chars=msg.resumed_text_chars,
                             pin_context=msg.pin_context, read_path=read_path,
                             tenant=tenant_of(msg), tenant_weight=self.share.weight(tenant_of(msg)),
                             done_to=self.inbox_address, queued_s=round(queued_s, 6))
        if not self.links.put(te_id, task):
            self._fail(msg, "te_lost", "the engine chosen for the request did not take it in "
                                       "time; retry")
            return False
        self.share.take(te_id, msg.request_id)  # a new attempt's replaces its task's
        self.tasks[msg.request_id] = Task(msg.request_id, te_id, msg.reply_to, prefill_te,
                                          msg.attempt, is_suspect)
        return True

    def _note_migrated(self, msg: SubmitRequest, te_id: str, num_tokens: int) -> None:
        self.num_migrated += 1
        log.warning("request %s resumed on %s (attempt %d, %d tokens of context)",
                    msg.request_id, te_id, msg.attempt, num_tokens)
        self.events("request_migrated", request_id=msg.request_id, te_id=te_id,
                    attempt=msg.attempt, prompt_tokens=num_tokens)

    def _job_layout(self, ids: list[int], exclude: frozenset[str] = frozenset(),
                    max_tokens: int | None = None, te_model: str | None = None) -> str:
        """colocated or disaggregated: the policy's choice among the TEs of
        te_model (None: of any model) that exist, TEs in exclude aside."""
        types = self.router.te_types(te_model, exclude)
        has_pair = {"prefill", "decode"} <= types
        if not has_pair:
            return "colocated"
        if "colocated" not in types:
            return "disaggregated"
        if self.pd_policy is None:
            return "colocated"
        return self.pd_policy.choose(ids, max_tokens=max_tokens)

    def _abort(self, msg: AbortRequest) -> None:
        for holder in (self.isolation, self.parking, self.share, self.turns):
            holder.drop(msg.request_id)  # whatever holds it lets it go
        task = self.tasks.get(msg.request_id)
        if task is not None:
            self.links.put(task.te_id, msg)  # it ends there: TaskDone
        else:
            self.share.forget(msg.request_id)  # it waited here: nothing runs it

    def _end_task(self, request_id: str) -> Task:
        """The task ended (or its TE is gone): its slot and its tenant's share free."""
        task = self.tasks.pop(request_id)
        self.share.give(request_id)
        self.share.forget(request_id)
        return task

    def _fail(self, msg: SubmitRequest, error: str, text: str, param: str | None = None) -> None:
        self.share.forget(msg.request_id)
        self._reply(msg.reply_to, RequestFailed(request_id=msg.request_id, error=error,
                                                message=text, param=param))

    def _reply(self, address: str | None, msg) -> None:
        if address is None:
            return
        self.replies.put(address, msg)

    # -- cluster state ------------------------------------------------------------
    def _on_cm(self, msg) -> None:
        if isinstance(msg, TEReport):
            self.router.on_report(msg)
            if self.dualpath is not None:
                self.dualpath.on_report(msg.te_id)
            for request_id in msg.finished:
                # The master is done with it (a slot frees), but the task ends
                # with its tokenizer's TaskDone: a tokenizer killed before the
                # last delta went out leaves it to fail with the TE (te_lost).
                task = self.tasks.get(request_id)
                if task is not None and task.te_id == msg.te_id:
                    self.share.give(request_id)
                    self.suspects.forget(request_id)  # it completed: not poison
        elif isinstance(msg, TEList):
            self._update_tes(msg)

    def _update_tes(self, msg: TEList) -> None:
        update = self.links.update(msg)
        if update is None:
            return  # an incomplete list (te_links.py)
        live, left = update
        # first: nothing routes to a TE that left, or that drains for scale-in
        self.router.update_tes([te for te in live if not te.draining])
        self.share.note_tes(live)
        self.isolation.note_listed([te.te_type for te in live])
        for te_id in left:
            self._fail_tasks_of(te_id, msg.down.get(te_id, ""))

    def _fail_tasks_of(self, te_id: str, part: str = "") -> None:
        for task in [t for t in self.tasks.values() if te_id in (t.te_id, t.prefill_te)]:
            self._end_task(task.request_id)
            if task.te_id != te_id:
                self.links.put(task.te_id, AbortRequest(request_id=task.request_id))
            crashes = self.suspects.crashed(task.request_id, te_id, part)
            if self.suspects.is_quarantined(task.request_id):
                self._quarantine(task, crashes)
                continue
            retry = task.attempt + 1 < self.max_attempts
            self._reply(task.reply_to, RequestFailed(
                request_id=task.request_id, error="te_lost" if retry else "engine_dead",
                message="the engine serving the request went down"
                        + ("" if retry else f" (attempt {task.attempt + 1} of {self.max_attempts})")))

    def _quarantine(self, task: Task, crashes: list[str]) -> None:
        log.error("request %s quarantined: in flight at %d TE crashes (%s)", task.request_id,
                  len(crashes), ", ".join(crashes))
        self.events("request_quarantined", request_id=task.request_id, crashed_tes=crashes,
                    crashed_parts=self.suspects.parts(task.request_id), crashes=len(crashes))
        self._reply(task.reply_to, RequestFailed(request_id=task.request_id, error=CRASHED,
                                                 message=crashed_text(crashes)))

    def close(self) -> None:
        for sock in [self.inbox, self.cm, self.links, self.replies]:
            sock.close()


def main(argv: list[str] | None = None) -> None:
    run_main("job-executor", "DeepServe job executor", argv, load_settings,
             lambda ctx, s, life: JobExecutor(ctx, s, life.event),
             lambda je: {"tasks": len(je.tasks), "migrated": je.num_migrated})


if __name__ == "__main__":
    main()
