"""What each member may tell the cluster manager and the job executor
([cluster] secure): the `admit` of their inboxes (ipc/sockets.py). A node's
key speaks for that node only.

cluster manager (cm_admit):
    the head's own node, a head's key     anything
    node N's key                          TEUp / TEDown / TEReport / ScaleEvent of
                                          N's own TEs (ids "N-...", as every joined
                                          node names its TEs); N's NodeReport, listing
                                          only N's TEs; N's TierReport
                                          nothing else (ModelDemand is a head's JE's)

So a member can neither list a TE under another's id (and be routed its
prompts), nor take another node's TEs out, nor skew the autoscaler.

job executor (je_admit): what gateways send (requests, aborts, contexts,
turns; gateways run on heads) only from a head's key; what TEs send (deltas,
failures, task ends) from any member.
"""

from __future__ import annotations

from deepserve.ipc import curve
from deepserve.messages.cache import TierReport
from deepserve.messages.control import TEDown, TEReport, TEUp
from deepserve.messages.engine import RequestDelta, RequestFailed, TaskDone
from deepserve.messages.scaling import NodeReport, ScaleEvent


FROM_TES = (RequestDelta, RequestFailed, TaskDone)
"""What TEs send a job executor; the rest of its inbox is the gateways'."""


def owns(node: str, te_id: str) -> bool:
    """TE `te_id` is node `node`'s (a joined node's TE ids carry its name)."""
    return te_id.startswith(f"{node}-")


def je_admit(member: tuple[str, str], msg) -> str:
    """"" to take `msg` from `member` (name, role), else why not."""
    if isinstance(msg, FROM_TES):
        return ""
    return curve.from_head(member, msg)


def cm_admit(member: tuple[str, str], msg) -> str:
    """"" to take `msg` from `member` (name, role), else why not."""
    if curve.own_or_head(member):
        return ""
    name = member[0]
    if isinstance(msg, TEUp):
        te_ids = [msg.info.te_id]
    elif isinstance(msg, (TEDown, TEReport, ScaleEvent)):
        te_ids = [msg.te_id]
    elif isinstance(msg, NodeReport):
        if msg.node != name:
            return f"a report for node {msg.node!r}"
        te_ids = [*msg.tes, *(te.te_id for te in msg.static)]
    elif isinstance(msg, TierReport):
        return ""
    else:
        return "only a head's key may send it"
    others = [te_id for te_id in te_ids if not owns(name, te_id)]
    return f"TE {others[0]!r} is not {name}'s" if others else ""
