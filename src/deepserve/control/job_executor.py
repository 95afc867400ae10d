"""Job executor: request -> job -> task(s), routed to a TE, tracked to its end.

    gateways ──SubmitRequest/AbortRequest──> [inbox PULL]
                                                 │ tokenize, route (control/router.py)
                                                 ▼
                              TE tokenizer inboxes (one PUSH per TE)
    CM ──TEList / TEReport (SUB)──> router: TE set, loads, cached blocks, finished tasks
    JE ──RequestFailed──> the request's reply_to (no TE, bad input, its TE went down)

A chat or completion request is a job of one `colocated` task, or, when the
PD policy (control/pd_policy.py: DeepServe Algorithm 1, step 1) says the
request's shape is served better disaggregated, of a `prefill` and a
`decode` task: the decode TE gets the request with prefill_from = the chosen
prefill TE and orders the KV from it itself (messages/pd.py). Either way the
output streams from one TE straight to the gateway; the JE only learns that
the job ended (TEReport.finished of that TE), or that one of its TEs left
the list, which fails it (and aborts the other task).

`python -m deepserve.control.job_executor --conf RUN_DIR/node.json --role
job-executor`: its sockets are the run's, [router] and [node] model /
max_attempts come from the resolved config (load_settings).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq

from deepserve.actor import ActorLife
from deepserve.config.child import ChildArgs, parse_child_args, print_config
from deepserve.config.loading import read_run_config
from deepserve.config.node import RouterSection
from deepserve.control.pd_policy import PDPolicy
from deepserve.control.router import NoTEAvailable, Router
from deepserve.errors import InvalidRequestError
from deepserve.ipc.outboxes import Outboxes
from deepserve.ipc.sockets import PullSocket, PushSocket, SubSocket
from deepserve.messages.control import FromClusterManager, TEList, TEReport
from deepserve.messages.engine import AbortRequest, RequestFailed, SubmitRequest
from deepserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_IN = SubmitRequest | AbortRequest


class EventSink(Protocol):
    """A health-log event out (ActorLife.event in the process; a list in tests)."""

    def __call__(self, event: str, **details) -> None: ...


def _no_event(event: str, **details) -> None:
    pass


@dataclass
class Task:
    request_id: str
    te_id: str  # the TE that streams to the caller (colocated or decode)
    reply_to: str | None
    prefill_te: str | None = None  # disaggregated: where its KV is computed
    attempt: int = 0


class JobExecutor:
    def __init__(self, ctx: zmq.Context, inbox: str, cm_pub: str, model: str, router: Router,
                 pd_policy=None, max_attempts: int = 3, events: EventSink = _no_event):
        self.ctx = ctx
        self.inbox = PullSocket(ctx, inbox, bind=True, type=_IN)
        self.cm = SubSocket(ctx, cm_pub, bind=False, type=FromClusterManager)
        self.tokenizer = Tokenizer(model)
        self.router = router
        self.pd_policy = pd_policy  # None: colocated unless only PD pairs exist
        self.max_attempts = max_attempts  # a request runs on at most this many TEs
        self.events = events  # health events (request_migrated) to the supervisor
        self.num_migrated = 0
        self.te_sockets: dict[str, PushSocket] = {}
        self.te_addresses: dict[str, str] = {}
        self.replies = Outboxes(ctx)  # to reply_to addresses: never blocks for long
        self.tasks: dict[str, Task] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.cm.socket, zmq.POLLIN)

    def step(self, timeout_ms: int = 200) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self.cm.socket in events:
            for msg in self.cm.drain():
                self._on_cm(msg)
        if self.inbox.socket in events:
            for msg in self.inbox.drain():
                self._submit(msg) if isinstance(msg, SubmitRequest) else self._abort(msg)

    # -- requests ----------------------------------------------------------------
    def _submit(self, msg: SubmitRequest) -> None:
        if msg.attempt >= self.max_attempts:
            return self._fail(msg, "engine_dead", f"the request's TE failed {msg.attempt} times; "
                              f"giving up after {self.max_attempts} attempts")
        prefill_te = prefill_from = None
        try:
            _, ids = self.tokenizer.request_ids(msg.prompt, msg.prompt_token_ids, msg.messages)
            if self._job_layout(ids) == "disaggregated":
                prefill_te = self.router.route(ids, msg.salt, te_type="prefill")
                prefill_from = self.te_addresses[prefill_te]
                te_id = self.router.route(ids, msg.salt, te_type="decode")
            else:
                te_id = self.router.route(ids, msg.salt)
        except InvalidRequestError as e:
            return self._fail(msg, "invalid_request", str(e), e.param)
        except NoTEAvailable as e:
            return self._fail(msg, "engine_dead", f"no TE can take the request: {e}")
        task = SubmitRequest(request_id=msg.request_id, prompt_token_ids=ids,
                             sampling=msg.sampling, salt=msg.salt, reply_to=msg.reply_to,
                             prefill_from=prefill_from, attempt=msg.attempt)
        self.tasks[msg.request_id] = Task(msg.request_id, te_id, msg.reply_to, prefill_te,
                                          msg.attempt)
        self.te_sockets[te_id].put(task)
        if msg.attempt:
            self.num_migrated += 1
            log.warning("request %s resumed on %s (attempt %d, %d tokens of context)",
                        msg.request_id, te_id, msg.attempt, len(ids))
            self.events("request_migrated", request_id=msg.request_id, te_id=te_id,
                        attempt=msg.attempt, prompt_tokens=len(ids))

    def _job_layout(self, ids: list[int]) -> str:
        """colocated or disaggregated: the policy's choice among what exists."""
        types = {te.te_type for te in self.router.tes.values()}
        has_pair = {"prefill", "decode"} <= types
        if not has_pair:
            return "colocated"
        if "colocated" not in types:
            return "disaggregated"
        return "colocated" if self.pd_policy is None else self.pd_policy.choose(ids)

    def _abort(self, msg: AbortRequest) -> None:
        task = self.tasks.get(msg.request_id)
        if task is not None and task.te_id in self.te_sockets:
            self.te_sockets[task.te_id].put(msg)

    def _fail(self, msg: SubmitRequest, error: str, text: str, param: str | None = None) -> None:
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
            for request_id in msg.finished:
                task = self.tasks.get(request_id)
                if task is not None and task.te_id == msg.te_id:
                    del self.tasks[request_id]
        elif isinstance(msg, TEList):
            self._update_tes(msg)

    def _update_tes(self, msg: TEList) -> None:
        live = {te.te_id: te for te in msg.tes}
        for te_id in set(self.te_sockets) - set(live):
            self.te_sockets.pop(te_id).close()
            self.te_addresses.pop(te_id, None)
            self._fail_tasks_of(te_id)
        for te_id, te in live.items():
            if self.te_addresses.get(te_id) != te.address:
                if te_id in self.te_sockets:
                    self.te_sockets.pop(te_id).close()
                self.te_sockets[te_id] = PushSocket(self.ctx, te.address, bind=False)
                self.te_addresses[te_id] = te.address
        self.router.update_tes(msg.tes)

    def _fail_tasks_of(self, te_id: str) -> None:
        for task in [t for t in self.tasks.values() if te_id in (t.te_id, t.prefill_te)]:
            del self.tasks[task.request_id]
            if task.te_id != te_id and task.te_id in self.te_sockets:
                self.te_sockets[task.te_id].put(AbortRequest(request_id=task.request_id))
            retry = task.attempt + 1 < self.max_attempts
            self._reply(task.reply_to, RequestFailed(
                request_id=task.request_id, error="te_lost" if retry else "engine_dead",
                message=f"TE {te_id} went down while serving the request"
                        + ("" if retry else f" (attempt {task.attempt + 1} of {self.max_attempts})")))

    def close(self) -> None:
        for sock in [self.inbox, self.cm, *self.te_sockets.values(), self.replies]:
            sock.close()


class JESettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the job executor takes from the node's resolved config."""

    inbox: str
    cm_pub: str
    model: str
    """[node] model: the tokenizer of every request."""
    max_attempts: int
    """[node] max_attempts."""
    router: RouterSection
    """[router]: routing policy, PD policy and its files and thresholds."""


def load_settings(args: ChildArgs) -> JESettings:
    config, run = read_run_config(args.conf)
    return JESettings(inbox=run.je, cm_pub=run.cm_pub, model=config.node.model,
                      max_attempts=config.node.max_attempts, router=config.router)


def build(ctx: zmq.Context, s: JESettings, events: EventSink = _no_event) -> JobExecutor:
    r = s.router
    options = {} if r.balance_threshold is None else {"balance_threshold": r.balance_threshold}
    pd_policy = None
    if r.pd_policy is not None:
        pd_policy = PDPolicy.from_files(r.pd_policy, r.pd_heatmap, r.pd_predictor,
                                        **msgspec.structs.asdict(r.pd_options))
    return JobExecutor(ctx, s.inbox, s.cm_pub, s.model, Router(r.policy, **options), pd_policy,
                       s.max_attempts, events)


def main(argv: list[str] | None = None) -> None:
    args = parse_child_args(argv, "job-executor", "DeepServe job executor")
    settings = load_settings(args)
    if args.print_config:
        return print_config(settings)
    life = ActorLife("job-executor", parent_pid=args.parent_pid)
    ctx = zmq.Context()
    je = build(ctx, settings, life.event)
    try:
        life.ready()
        life.run(je.step, lambda: {"tasks": len(je.tasks), "migrated": je.num_migrated})
    finally:
        je.close()
        ctx.term()
        life.close()


if __name__ == "__main__":
    main()
