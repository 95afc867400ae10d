"""Chaos runs (bin/deepserve-chaos): a seeded mixed workload through a node's
gateway while seeded drill faults hit it, for minutes to hours (floor 5,
beside drill/: nothing below imports this package). The modules:

    __main__   the CLI: start the node, run, report, stop, /dev/shm check
    runner     one run: contexts, oracle, load + faults + samples, verdicts
    workload   the seeded request mix (chat / completions, streamed or not,
               n > 1, contexts, two tenants, hostile requests, a second
               model that scales to zero between its blocks of requests)
    load       sending the mix, `concurrency` at a time (drill's LoadDriver.send)
    schedule   the seeded fault schedule; duration parsing
    faults     one scheduled fault, run by the drill's Drill (arm/inject/poll)
    checks     the oracle and each request's verdict
    resources  RSS / fds of the node's processes, its /dev/shm, growth
    report     the JSON report and its text
    timeline   the PNG timeline (matplotlib)

Fault injection, proofs, health-log reading and the SSE client are the drill
package's (drill/injection.py, proof.py, health_events.py, stream.py).
"""
