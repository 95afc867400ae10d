"""Fault-injection drills, driven from outside a node (floor 5: nothing below
imports this package). The modules, from the command line down:

    __main__       the CLI (bin/deepserve-drill)
    runner         one drill: load, fault, proof, recovery, report
    scenarios      the scenario table: target, fault, deadline
    injection      applying a fault and taking it back
    proof          showing the fault took effect (a drill without it fails)
    prompts        the load's prompts and the cache probe
    health_events  the node's health.jsonl as the drill reads it
    load           the load driver (httpx, asyncio)
    stream         one SSE stream -> RequestRecord
    sse            the SSE parser, shared with tools/
    report         the verdict

This file imports nothing, so importing one submodule never pulls the load
driver.
"""
