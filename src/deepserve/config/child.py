"""The command line every node-level child takes: its config is a file, not flags.

    python -m MODULE --conf RUN_DIR/node.json --role NAME --parent-pid PID
                     [--te-id ID --run-id ID [--model NAME]]   (a TE; --model: a scaled one)
                     [--te-id NAME --pool]      (a pre-warmed process, told later what to be)
                     [--print-config]           (print the effective config and exit)

The node writes the resolved NodeConfig (config/loading.py) once; each child
reads it and takes its role's part (its `load_settings`). The same function
builds the effective config in the child and in tests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec

ROLES = ("cluster-manager", "job-executor", "gateway", "te", "kv-cache")


@dataclass(frozen=True)
class ChildArgs:
    conf: str
    """The resolved node config (node.json in the run directory)."""
    role: str
    parent_pid: int | None = None
    """Stop once this process is no longer the parent."""
    te_id: str | None = None
    run_id: str | None = None
    """A TE's shared-memory run id: each incarnation has its own (the node rewrites it)."""
    print_config: bool = False
    model: str | None = None
    """A scaled TE's model ([[model]] name); None: a [[te]] TE of the [node] model."""
    pool: bool = False
    """A pre-warmed process: te_id names it until an Assign names its TE."""


def parse_child_args(argv: list[str] | None, role: str, description: str) -> ChildArgs:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--conf", required=True, help="resolved node config (node.json)")
    ap.add_argument("--role", required=True, choices=(role,))
    ap.add_argument("--parent-pid", type=int, default=None)
    if role == "te":
        ap.add_argument("--te-id", required=True)
        ap.add_argument("--run-id", default=None,
                        help="names this TE's shared memory (the supervisor sweeps it)")
        ap.add_argument("--model", default=None, help="a scaled TE: the model it serves")
        ap.add_argument("--pool", action="store_true",
                        help="start pre-warmed and wait to be assigned a TE")
    if role == "kv-cache":
        ap.add_argument("--run-id", default=None,
                        help="names its shared memory (the supervisor sweeps it)")
    ap.add_argument("--print-config", action="store_true",
                    help="print this process's effective config as JSON and exit")
    args = ap.parse_args(argv)
    return ChildArgs(args.conf, args.role, args.parent_pid, getattr(args, "te_id", None),
                     getattr(args, "run_id", None), args.print_config,
                     getattr(args, "model", None), getattr(args, "pool", False))


def child_argv(conf: str | Path, role: str, te_id: str | None = None,
               run_id: str | None = None, model: str | None = None,
               pool: bool = False) -> list[str]:
    """The arguments the node gives a child (it appends --parent-pid)."""
    argv = ["--conf", str(conf), "--role", role]
    if te_id is not None:
        argv += ["--te-id", te_id, "--run-id", run_id or te_id]
    elif run_id is not None:
        argv += ["--run-id", run_id]
    if model is not None:
        argv += ["--model", model]
    if pool:
        argv += ["--pool"]
    return argv


def print_config(settings) -> None:
    """--print-config: the effective config, JSON, on stdout."""
    print(msgspec.json.encode(settings, enc_hook=_plain).decode(), flush=True)


def _plain(obj):
    if isinstance(obj, Mapping):
        return dict(obj)
    raise NotImplementedError(type(obj))
