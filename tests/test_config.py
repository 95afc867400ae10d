"""One config schema: every key of every section reaches the process that
uses it, through the same code a child runs (`--conf PATH --role NAME`), and
every bad file is refused with the file, the section and the key named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from deepserve.config import EngineConfig, load_config
from deepserve.config.engine import MAX_KV_LOAD_LAYERS
from deepserve.config.child import parse_child_args
from deepserve.config.loading import load_node_config, write_run_config
from deepserve.config.models import ModelSection, ModelSpec, ScalingSection, SLOSection
from deepserve.config.node import (ENGINE_OPTIONS, DualPathOptions, FLAT_SECTIONS, GatewaySection, NodeConfig,
                                   NodeSection, PDOptions, RouterSection, RunAddresses,
                                   SupervisorConfig, TESection, TESpec, ClusterSection)
from deepserve.tiers import tier_server
from deepserve.control.cm import cluster_manager
from deepserve.control.je import job_executor
from deepserve.engine.te import te_server
from deepserve.gateway import __main__ as gateway_main
from deepserve.ipc import curve, curve_keys
from deepserve.supervisor.node import Node
from deepserve.supervisor.node_config import with_cluster, with_models, with_port, with_quantize
from deepserve.tiers import tier_server

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"cluster-manager": cluster_manager, "job-executor": job_executor,
           "gateway": gateway_main, "te": te_server, "kv-cache": tier_server}
BASE = {"node": {"model": "models/m"}, "te": [{}]}


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # str, int, float, bool: TOML writes them the same way


def write_toml(tmp_path: Path, tables: dict) -> Path:
    """tables: section -> {key: value}; "te", "model": lists of [[te]] / [[model]] tables."""
    lines = []
    for section, body in tables.items():
        is_array = section in ("te", "model")
        for table in (body if is_array else [body]):
            lines.append(f"[[{section}]]" if is_array else f"[{section}]")
            lines += [f"{key} = {_toml(value)}" for key, value in table.items()]
    (tmp_path / "conf").mkdir(exist_ok=True)
    path = tmp_path / "conf" / "node.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def resolve(path: Path, run_dir: Path) -> Path:
    """What the node does before it starts children: resolve, add the run, write."""
    config = load_node_config(path)
    run = RunAddresses.for_node(run_dir, "run1", [te.te_id for te in config.tes],
                                config.node.host_cache_bytes > 0, config.cluster)
    return write_run_config(config.with_run(run), run_dir / "node.json")


def effective(role: str, conf: Path):
    """The child's own config-loading path, given the argv the node gives it."""
    if role == "node":
        return load_node_config(conf)
    if role == "supervisor":
        return load_node_config(conf).supervisor
    resolved = resolve(conf, conf.parent.parent)
    extra = {"te": ["--te-id", "te0", "--run-id", "r0"], "kv-cache": ["--run-id", "r0"]
             }.get(role, [])
    if role == "te-scaled":  # a TE the autoscaler added, of the first [[model]]
        config = load_node_config(conf)
        if not config.models:
            return None
        role, extra = "te", ["--te-id", "x-0", "--run-id", "r0", "--model",
                             config.models[0].name]
    args = parse_child_args(["--conf", str(resolved), "--role", role, *extra], role, "")
    return MODULES[role].load_settings(args)


def at(tmp: Path, rel: str) -> str:
    return str(tmp / rel)


ENGINE_VALUES = {
    "dtype": "bfloat16", "block_size": 32, "num_kv_blocks": 64, "kv_cache_memory": 1 << 20,
    "max_num_batched_tokens": 333, "max_num_seqs": 7, "max_model_len": 128,
    "enable_prefix_caching": False, "seed": 5, "tp": 2, "async_scheduling": False,
    "num_threads": 3, "startup_timeout_s": 77.0, "kv_transfer_backend": "tcp",
    "kv_transfer_layerwise": True, "kv_transfer_timeout_s": 9.0, "storage_read_gbps": 0.5,
    "kv_bind_host": "10.0.0.7", "timeline_dir": "/tmp/timeline", "kv_load_layers": 3,
    "kv_stream_bytes": 1 << 20, "dualpath_hop": "stream", "light_step_tokens": 128,
    "quantize": "int8"}
"""A valid non-default value of every engine option but `processes` (implied True)."""

# (section, key, value in the TOML, role that uses it, what that role sees -> expected)
CASES = [
    ("node", "model", "models/other", "job-executor",
     lambda s, t: list(s.models.values()) == [at(t, "models/other")]),
    ("node", "model", "/abs/m", "te", lambda s, t: s.engine.model == "/abs/m"),
    ("node", "served_model", "sm", "gateway", lambda s, t: s.served_model == "sm"),
    ("node", "served_model", "sm", "te", lambda s, t: s.served_model == "sm"),
    ("node", "host", "127.0.0.2", "gateway", lambda s, t: s.host == "127.0.0.2"),
    ("node", "port", 8123, "gateway", lambda s, t: s.port == 8123),
    ("node", "startup_timeout_s", 5.5, "node", lambda s, t: s.node.startup_timeout_s == 5.5),
    ("node", "te_timeout_s", 2.5, "cluster-manager", lambda s, t: s.te_timeout_s == 2.5),
    ("node", "num_devices", 4, "node", lambda s, t: s.node.num_devices == 4),
    ("node", "max_attempts", 7, "job-executor", lambda s, t: s.max_attempts == 7),
    ("node", "host_cache_bytes", 1 << 20, "kv-cache", lambda s, t: s.host_bytes == 1 << 20),
    ("node", "host_cache_bytes", 1 << 20, "te", lambda s, t: s.kv_cache != ""),
    ("node", "disk_cache_dir", "var/kv", "kv-cache", lambda s, t: s.disk_dir == at(t, "var/kv")),
    ("node", "disk_cache_bytes", 4096, "kv-cache", lambda s, t: s.disk_bytes == 4096),
    ("node", "disk_fsync", "always", "kv-cache", lambda s, t: s.fsync == "always"),
    ("node", "context_cache_bytes", 1000, "kv-cache", lambda s, t: s.pin_bytes == 1000),
    ("node", "disk_scrub_bytes_per_s", 1000, "kv-cache", lambda s, t: s.scrub_bytes_per_s == 1000),
    ("node", "tool_call_pin_s", 7.5, "job-executor", lambda s, t: s.turn_pin_s == 7.5),
    ("node", "cache_cost_model", False, "te", lambda s, t: s.cache_cost_model is False),
    ("node", "gguf_cache_dir", "var/gg", "node",
     lambda s, t: s.node.gguf_cache_dir == at(t, "var/gg")),
    ("gateway", "api_keys", {"k": "t"}, "gateway", lambda s, t: dict(s.api_keys) == {"k": "t"}),
    ("gateway", "admin_keys", ["k"], "gateway", lambda s, t: s.admin_keys == ("k",)),
    ("gateway", "max_open_requests", 9, "gateway", lambda s, t: s.max_open_requests == 9),
    ("gateway", "request_timeout_s", 4.5, "gateway", lambda s, t: s.request_timeout_s == 4.5),
    ("gateway", "max_prompt_chars", 99, "gateway", lambda s, t: s.max_prompt_chars == 99),
    ("gateway", "default_max_tokens", 3, "gateway", lambda s, t: s.default_max_tokens == 3),
    ("gateway", "max_body_bytes", 4096, "gateway", lambda s, t: s.max_body_bytes == 4096),
    ("gateway", "max_connections", 7, "gateway", lambda s, t: s.max_connections == 7),
    ("gateway", "read_timeout_s", 2.5, "gateway", lambda s, t: s.read_timeout_s == 2.5),
    ("gateway", "write_timeout_s", 3.5, "gateway", lambda s, t: s.write_timeout_s == 3.5),
    ("gateway", "max_queued_replies", 5, "gateway", lambda s, t: s.max_queued_replies == 5),
    ("router", "policy", "load", "job-executor", lambda s, t: s.router.policy == "load"),
    ("router", "balance_threshold", 12.0, "job-executor",
     lambda s, t: s.router.balance_threshold == 12.0),
    ("router", "pd_policy", "threshold", "job-executor",
     lambda s, t: s.router.pd_policy == "threshold"),
    ("router", "pd_heatmap", "conf/h.json", "job-executor",
     lambda s, t: s.router.pd_heatmap == at(t, "conf/h.json")),
    ("router", "pd_predictor", "conf/p.json", "job-executor",
     lambda s, t: s.router.pd_predictor == at(t, "conf/p.json")),
    ("router", "token_continuity", False, "job-executor", lambda s, t: s.continuity is False),
    ("router", "dualpath", {"alpha_tokens": 7, "beta_tokens": 9, "z_factor": 1.5,
                            "read_paths": "prefill"},
     "job-executor", lambda s, t: s.router.dualpath == DualPathOptions(
         alpha_tokens=7, beta_tokens=9, z_factor=1.5, read_paths="prefill")),
    ("router", "isolate_suspects", True, "job-executor",
     lambda s, t: s.router.isolate_suspects is True),
    ("router", "pd_options", {"margin": 0.5, "min_prompt_len": 10, "max_decode_len": 20},
     "job-executor", lambda s, t: s.router.pd_options == PDOptions(margin=0.5, min_prompt_len=10,
                                                                   max_decode_len=20)),
    *[("supervisor", key, value, "supervisor", lambda s, t, k=key, v=value: getattr(s, k) == v)
      for key, value in {"heartbeat_deadline_s": 1.5, "progress_deadline_s": 2.5,
                         "startup_grace_s": 30.0, "memory_limit_mb": 512.0,
                         "restart_base_delay_s": 0.25, "restart_max_delay_s": 9.0,
                         "max_restarts": 2, "restart_window_s": 20.0, "kill_grace_s": 0.5,
                         "drill": True}.items()],
    ("supervisor", "log_dir", "var/logs", "supervisor",
     lambda s, t: s.log_dir == at(t, "var/logs")),
    ("te", "type", "decode", "te", lambda s, t: s.te_type == "decode"),
    ("te", "count", 3, "node", lambda s, t: [te.te_id for te in s.tes] == ["te0", "te1", "te2"]),
    ("te", "priority", 4, "node", lambda s, t: s.tes[0].priority == 4),
    ("te", "processes", False, "te", lambda s, t: s.engine.processes is True),  # implied
    *[("te", key, value, "te", lambda s, t, k=key, v=value: getattr(s.engine, k) == v)
      for key, value in ENGINE_VALUES.items()],
    ("model", "path", "models/x", "node", lambda s, t: _m(s, "path") == at(t, "models/x")),
    ("model", "name", "xx", "job-executor", lambda s, t: "xx" in s.models),
    ("model", "name", "xx", "gateway", lambda s, t: "xx" in s.served_models),
    ("model", "min_tes", 0, "cluster-manager", lambda s, t: s.models and
     s.models[0].min_tes == 0 and not s.initial),
    ("model", "max_tes", 5, "cluster-manager", lambda s, t: _m(s, "max_tes") == 5),
    ("model", "idle_s", 7.5, "cluster-manager", lambda s, t: _m(s, "idle_s") == 7.5),
    ("model", "slo", {"ttft_ms": 100.0, "tpot_ms": 20.0, "percentile": 0.5}, "cluster-manager",
     lambda s, t: _m(s, "slo") == SLOSection(ttft_ms=100.0, tpot_ms=20.0, percentile=0.5)),
    ("model", "processes", False, "te-scaled", lambda s, t: s is not None
     and s.engine.processes is True),  # implied
    *[("model", key, value, "te-scaled", lambda s, t, k=key, v=value: s is not None
       and getattr(s.engine, k) == v) for key, value in ENGINE_VALUES.items()],
    ("scaling", "pool_size", 3, "node", lambda s, t: s.scaling.pool_size == 3),
    ("scaling", "weight_cache_bytes", 1024, "node", lambda s, t:
     s.scaling.weight_cache_bytes == 1024),
    ("scaling", "queue_timeout_s", 4.5, "job-executor", lambda s, t: s.queue_timeout_s == 4.5),
    *[("scaling", key, value, "cluster-manager",
       lambda s, t, k=key, v=value: getattr(s.scaling, k) == v)
      for key, value in {"window_s": 3.5, "out_queue_per_te": 4.0, "in_load_per_te": 0.25,
                         "out_cooldown_s": 1.5, "in_cooldown_s": 2.5,
                         "in_sustain_s": 6.5}.items()],
    ("cluster", "host", "10.0.0.2", "te", lambda s, t: s.inbox == "tcp://10.0.0.2:7408"
     and s.engine.kv_bind_host == "10.0.0.2"),
    ("cluster", "host", "10.0.0.2", "cluster-manager",
     lambda s, t: (s.inbox, s.pub) == ("tcp://10.0.0.2:7400", "tcp://10.0.0.2:7401")),
    ("cluster", "host", "10.0.0.2", "gateway",
     lambda s, t: s.reply_address == "tcp://10.0.0.2:7403"
     and s.je_address == "tcp://10.0.0.2:7402"),  # standby heads' gateways submit there too
    ("cluster", "port", 9000, "cluster-manager", lambda s, t: s.inbox == "tcp://10.0.0.2:9000"),
    ("cluster", "head", "10.0.0.1:7500", "node", lambda s, t: s.cluster.joins
     and [te.te_id for te in s.tes] == ["n10-0-0-2-te0"]
     and RunAddresses.for_node(t, "r", ["x"], False, s.cluster).cm == "tcp://10.0.0.1:7500"),
    ("cluster", "name", "h7", "node", lambda s, t: [te.te_id for te in s.tes] == ["h7-te0"]),
    ("cluster", "secure", True, "node", lambda s, t: s.cluster.secure),
    ("cluster", "keys", "etc/k", "node", lambda s, t: s.cluster.keys.endswith("/etc/k")),
    ("cluster", "insecure", True, "node", lambda s, t: s.cluster.insecure),
    ("cluster", "standby", True, "node", lambda s, t: s.cluster.standby
     and RunAddresses.for_node(t, "r", [], False, s.cluster).je
     == "tcp://10.0.0.2:7402,tcp://10.0.0.1:7402"),
    ("cluster", "standby", True, "cluster-manager", lambda s, t:
     (s.inbox, s.pub) == ("tcp://10.0.0.2:7400,tcp://10.0.0.1:7400",
                          "tcp://10.0.0.2:7401,tcp://10.0.0.1:7401")),
    ("cluster", "failover_s", 7.5, "node", lambda s, t: s.cluster.failover_s == 7.5),
    ("cluster", "state_dir", "var/ds", "job-executor",
     lambda s, t: s.contexts_path == at(t, "var/ds") + "/contexts.json"),
]
OPEN = {"insecure": True}
"""A cluster host that is not loopback, without keys: said so (else refused)."""
WITH = {("cluster", "host"): OPEN,
        ("cluster", "port"): {"host": "10.0.0.2", **OPEN},
        ("cluster", "head"): {"host": "10.0.0.2", **OPEN},
        ("cluster", "name"): {"host": "10.0.0.2", "head": "10.0.0.1:7400", **OPEN},
        ("cluster", "secure"): {"host": "127.0.0.2"},  # loopback: allowed either way
        ("cluster", "keys"): OPEN,
        ("cluster", "insecure"): {"host": "127.0.0.2"},
        ("cluster", "standby"): {"host": "10.0.0.2", "head": "10.0.0.1:7400", **OPEN},
        ("cluster", "failover_s"): {"host": "10.0.0.2", "head": "10.0.0.1:7400", **OPEN},
        ("cluster", "state_dir"): {"host": "10.0.0.2", **OPEN},
        ("node", "tool_call_pin_s"): {**BASE["node"], "host_cache_bytes": 1 << 20},  # none: 0
        ("gateway", "admin_keys"): {"api_keys": {"k": "t"}},  # an admin key is an API key
        ("te", "dualpath_hop"): {"kv_stream_bytes": 1 << 20},
        ("model", "dualpath_hop"): {"kv_stream_bytes": 1 << 20}}
"""Keys a case needs next to its own (a joining node needs its host)."""
SECTION_TYPES = {"node": NodeSection, "gateway": GatewaySection, "router": RouterSection,
                 "supervisor": SupervisorConfig, "te": TESection, "model": ModelSection,
                 "scaling": ScalingSection, "cluster": ClusterSection}


def _m(settings, key):
    """A field of the first scalable model a role's settings hold (None: none)."""
    models = getattr(settings, "models", ())
    return getattr(models[0], key) if models else None


def test_every_key_of_every_section_has_a_case():
    keys = {(s, f) for s, t in SECTION_TYPES.items() for f in t.__struct_fields__}
    assert keys == {(section, key) for section, key, *_ in CASES}
    assert set(ENGINE_VALUES) | {"processes"} == set(ENGINE_OPTIONS)


@pytest.mark.parametrize("section, key, value, role, sees", CASES,
                         ids=[f"{c[0]}.{c[1]}->{c[3]}" for c in CASES])
def test_key_reaches_its_process(tmp_path, section, key, value, role, sees):
    tables = {"node": dict(BASE["node"]), "te": [{}]}
    if section == "te":
        tables["te"][0][key] = value
    elif section == "model":
        tables["model"] = [{"path": "models/x", key: value}]
    else:
        tables.setdefault(section, {})[key] = value
    both = {section: WITH[section, key]} if (section, key) in WITH else {}
    if section in ("te", "model"):  # an array of tables: the keys go into its first
        tables[section][0].update(both.pop(section, {}))
        both = {"te": [WITH[section, key]]} if (section, key) in WITH else {}
    for name, table in both.items():
        tables[name] = {**table, **tables[name]} if name != "te" else tables[name]
    settings = effective(role, write_toml(tmp_path, tables))
    assert sees(settings, tmp_path), settings
    (tmp_path / "default").mkdir()
    default = effective(role, write_toml(tmp_path / "default", {**BASE, **both}))
    assert key == "processes" or not sees(default, tmp_path / "default"), "set a non-default"


def test_run_addresses_reach_every_child(tmp_path):
    conf = write_toml(tmp_path, {"node": {"model": "m"}, "te": [{"count": 2}]})
    run = RunAddresses.in_dir(tmp_path, "run1", ["te0", "te1"])
    cm, je = effective("cluster-manager", conf), effective("job-executor", conf)
    gw, te = effective("gateway", conf), effective("te", conf)
    assert (cm.inbox, cm.pub) == (run.cm, run.cm_pub)
    assert (je.inbox, je.cm_pub) == (run.je, run.cm_pub)
    assert (gw.je_address, gw.cm_address, gw.reply_address) == (run.je, run.cm_pub, run.gw_reply)
    assert (te.inbox, te.cm, te.run_id) == (run.tes["te0"], run.cm, "r0")


@pytest.mark.slow
def test_real_children_print_their_effective_config(tmp_path):
    """The same values, read by real child processes from the file the node writes."""
    conf = write_toml(tmp_path, {
        "node": {"model": "models/m", "served_model": "sm", "port": 8124, "te_timeout_s": 2.5,
                 "max_attempts": 7},
        "gateway": {"api_keys": {"k": "t"}, "max_open_requests": 9},
        "router": {"policy": "load", "pd_policy": "threshold", "pd_options": {"margin": 0.5}},
        "te": [{"type": "prefill", "block_size": 32, "tp": 2}]})
    resolved = resolve(conf, tmp_path)
    assert resolved.stat().st_mode & 0o777 == 0o600  # it holds the API keys
    printed = {}
    for role, module in (("cluster-manager", "deepserve.control.cm.cluster_manager"),
                         ("job-executor", "deepserve.control.je.job_executor"),
                         ("gateway", "deepserve.gateway"), ("te", "deepserve.engine.te.te_server")):
        extra = ["--te-id", "te0"] if role == "te" else []
        out = subprocess.run([sys.executable, "-m", module, "--conf", str(resolved), "--role",
                              role, *extra, "--print-config"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        printed[role] = json.loads(out)
    assert printed["cluster-manager"]["te_timeout_s"] == 2.5
    je = printed["job-executor"]
    assert je["max_attempts"] == 7 and je["router"]["policy"] == "load"
    assert je["router"]["pd_options"]["margin"] == 0.5
    assert je["models"] == {"sm": at(tmp_path, "models/m")}
    gw = printed["gateway"]
    assert (gw["port"], gw["served_model"], gw["api_keys"], gw["max_open_requests"]) == (
        8124, "sm", {"k": "t"}, 9)
    te = printed["te"]
    assert (te["te_type"], te["engine"]["block_size"], te["engine"]["tp"]) == ("prefill", 32, 2)


def test_job_executor_applies_max_attempts_and_router(tmp_path, tiny_model):
    """Past the settings: the objects the JE builds from them."""
    conf = write_toml(tmp_path, {
        "node": {"model": str(tiny_model), "max_attempts": 7},
        "router": {"policy": "load", "balance_threshold": 12.0, "pd_policy": "threshold",
                   "pd_options": {"min_prompt_len": 10, "max_decode_len": 20, "margin": 0.5}},
        "te": [{}]})
    ctx = zmq.Context()
    je = job_executor.JobExecutor(ctx, effective("job-executor", conf))
    try:
        assert je.max_attempts == 7
        assert (je.router.policy, je.router.balance_threshold) == ("load", 12.0)
        p = je.pd_policy
        assert (p.mode, p.min_prompt_len, p.max_decode_len, p.margin) == ("threshold", 10, 20, 0.5)
    finally:
        je.close()
        ctx.term()


# -- refusals: the file, the section and the key, always --------------------------------------

@pytest.mark.parametrize("tables, where", [
    ({"bogus": {"a": 1}}, "unknown section(s) [bogus]"),
    ({"node": {"colour": 1}}, "[node] colour: unknown key"),
    ({"gateway": {"colour": 1}}, "[gateway] colour: unknown key"),
    ({"router": {"colour": 1}}, "[router] colour: unknown key"),
    ({"router": {"pd_options": {"colour": 1}}}, "[router] pd_options.colour: unknown key"),
    ({"supervisor": {"colour": 1}}, "[supervisor] colour: unknown key"),
    ({"te": [{}, {"colour": 1}]}, "[[te]] #2 colour: unknown key"),
    ({"node": {"port": "80"}}, "[node] port: Expected `int`, got `str`"),
    ({"gateway": {"api_keys": {"k": 1}}}, "[gateway] api_keys"),
    ({"gateway": {"api_keys": {"k": "t"}, "admin_keys": ["k", "sk-x"]}},
     "[gateway] admin_keys: entry 2 is not a key of api_keys"),
    ({"gateway": {"admin_keys": ["k"]}}, "[gateway] admin_keys: entry 1 is not a key"),
    ({"router": {"balance_threshold": "x"}}, "[router] balance_threshold: Expected `float"),
    ({"supervisor": {"heartbeat_deadline_s": -1}},
     "[supervisor] heartbeat_deadline_s: Expected `float` > 0.0, got -1"),
    ({"node": {"port": 70000}}, "[node] port: Expected `int` <= 65535, got 70000"),
    ({"node": {"max_attempts": 0}}, "[node] max_attempts: Expected `int` >= 1, got 0"),
    ({"gateway": {"max_open_requests": 0}}, "[gateway] max_open_requests: Expected `int` >= 1"),
    ({"router": {"policy": "random"}}, "[router] policy: Invalid enum value 'random'"),
    ({"router": {"pd_policy": "sometimes"}}, "[router] pd_policy: Invalid enum value"),
    ({"supervisor": {"max_restarts": -1}}, "[supervisor] max_restarts: Expected `int` >= 0"),
    ({"te": [{"type": "both"}]}, "[[te]] #1 type: Invalid enum value 'both'"),
    ({"te": [{"count": 0}]}, "[[te]] #1 count: Expected `int` >= 1, got 0"),
    ({"te": [{"block_size": 0}]}, "[[te]] block_size: must be a positive integer, got 0"),
    ({"te": [{"kv_transfer_backend": "pigeon"}]}, "[[te]] kv_transfer_backend: must be"),
    ({"te": [{"tp": "2"}]}, "[[te]] #1 tp: Expected `int`, got `str`"),
    ({"te": []}, "[[te]] a node needs at least one [[te]]"),
])
def test_bad_files_name_file_section_and_key(tmp_path, tables, where):
    merged = {"node": {"model": "m", **tables.pop("node", {})}, **tables}
    merged.setdefault("te", [{}])
    path = write_toml(tmp_path, merged)
    with pytest.raises(ValueError) as info:
        load_node_config(path)
    assert str(info.value).startswith(f"{path}: ") and where in str(info.value), str(info.value)


def test_te_must_be_an_array_and_model_is_required(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "x.toml"
    path.write_text('[node]\nmodel = "m"\n[te]\ncount = 1\n')
    with pytest.raises(ValueError, match=r"\[te\]: write TEs as \[\[te\]\]"):
        load_node_config(path)
    path.write_text("[node]\nport = 1\n[[te]]\n")
    with pytest.raises(ValueError, match=r"x.toml: \[node\] model: required"):
        load_node_config(path)


def test_overrides_and_command_line_port_are_checked_and_reach_children(tmp_path):
    conf = write_toml(tmp_path, BASE)
    with pytest.raises(ValueError, match=r"\[node\] port: Expected `int` <= 65535"):
        load_node_config(conf, overrides={"port": 99999})
    with pytest.raises(ValueError, match="override 'colour'"):
        load_node_config(conf, overrides={"colour": 1})
    with pytest.raises(ValueError, match="gateway listens beyond this host"):  # no api_keys
        with_port(load_node_config(conf), "0.0.0.0", 9)
    conf = write_toml(tmp_path, {**BASE, "gateway": {"api_keys": {"k": "t"}}})
    config = with_port(load_node_config(conf, overrides={"max_open_requests": 5}), "0.0.0.0", 9)
    run = RunAddresses.in_dir(tmp_path, "r", ["te0"])
    resolved = write_run_config(config.with_run(run), tmp_path / "node.json")
    gw = gateway_main.load_settings(parse_child_args(
        ["--conf", str(resolved), "--role", "gateway"], "gateway", ""))
    assert (gw.host, gw.port, gw.max_open_requests) == ("0.0.0.0", 9, 5)


def test_child_refuses_another_role_and_an_unresolved_file(tmp_path):
    with pytest.raises(SystemExit):
        parse_child_args(["--conf", "x", "--role", "gateway"], "job-executor", "")
    conf = write_toml(tmp_path, BASE)
    unresolved = tmp_path / "plain.json"
    unresolved.write_bytes(msgspec.json.encode(load_node_config(conf)))
    args = parse_child_args(["--conf", str(unresolved), "--role", "cluster-manager"],
                            "cluster-manager", "")
    with pytest.raises(ValueError, match="no run addresses"):
        cluster_manager.load_settings(args)


def test_flat_view_and_build():
    names = [f for s in FLAT_SECTIONS for f in SECTION_TYPES[s].__struct_fields__]
    assert len(names) == len(set(names))  # config.port is unambiguous
    assert not set(names) & set(NodeConfig.__struct_fields__)
    assert not set(names) & set(dir(NodeConfig))  # no method shadows config.model & co
    config = NodeConfig.build(model="/m", port=9, max_open_requests=4, policy="load",
                              tes=[TESpec("te0", "colocated", {"tp": 2})])
    assert (config.port, config.max_open_requests, config.policy) == (9, 4, "load")
    assert config.model == "/m"
    assert config.node.served_model == "m" and config.tes[0].num_devices == 2
    with pytest.raises(AttributeError):
        config.colour
    with pytest.raises(ValueError, match="unknown node config key 'colour'"):
        NodeConfig.build(model="/m", colour=1, tes=[TESpec("te0", "colocated")])
    with pytest.raises(msgspec.ValidationError, match="port"):
        NodeConfig.build(model="/m", port=0, tes=[TESpec("te0", "colocated")])
    with pytest.raises(ValueError, match="type must be one of"):
        NodeConfig.build(model="/m", tes=[TESpec("te0", "sideways")])


@pytest.mark.parametrize("name, model", [
    ("node", "smollm2-135m-instruct"),  # the built-in model bin/deepserve-up imports
    ("pd", "tiny"), ("drill", "tiny"), ("cluster-node", "tiny")])
def test_shipped_node_confs_load(name, model):
    config = load_node_config(ROOT / "conf" / f"{name}.toml")
    assert config.node.model == str(ROOT / "models" / model) and config.tes
    assert config.node.gguf_cache_dir == str(ROOT / "models" / "gguf")


def test_the_shipped_scaled_cluster_confs_place_every_te_on_joined_nodes():
    """conf/cluster-scaled-*.toml: a head without devices whose [[model]] starts
    at zero (and none at boot), and a capacity-only node: no model, no [[te]]."""
    head = load_node_config(ROOT / "conf" / "cluster-scaled-head.toml")
    assert head.node.num_devices == 0 and not head.tes and head.initial_scaled_tes() == {}
    [model] = head.models
    assert model.path == str(ROOT / "models" / "tiny") and model.min_tes == 0
    node = load_node_config(ROOT / "conf" / "cluster-scaled-node.toml")
    assert node.cluster.joins and not node.tes and not node.models and not node.node.model


def test_num_devices_zero_is_only_for_a_head_of_many_hosts():
    spec = ModelSpec(name="x", path="/x", min_tes=1)
    head = NodeConfig.build(num_devices=0, models=[spec], cluster=ClusterSection(insecure=True, host="h"))
    assert head.initial_scaled_tes() == {}  # min_tes: the CM places them on joined nodes
    assert NodeConfig.build(num_devices=1, models=[spec]).initial_scaled_tes() == {"x-0": "x"}
    for bad in (dict(models=[spec]),  # one host: nothing would ever start
                dict(model="/m", tes=[TESpec("te0", "colocated")], cluster=ClusterSection(
                    host="h")),  # a [[te]] that could never be placed
                dict(model="/m", cluster=ClusterSection(insecure=True, host="h2", head="h:7400"))):
        with pytest.raises(ValueError, match="num_devices = 0"):
            NodeConfig.build(num_devices=0, **bad)
    with pytest.raises(msgspec.ValidationError, match="num_devices"):
        NodeConfig.build(num_devices=-1, models=[spec])


@pytest.mark.parametrize("name, tp", [("engine", 1), ("engine-tp2", 2)])
def test_shipped_engine_confs_load(name, tp):
    config = load_config(ROOT / "conf" / f"{name}.toml")
    assert isinstance(config, EngineConfig) and config.tp == tp and config.processes


def test_conf_node_toml_documents_every_key_and_only_real_ones():
    """conf/node.toml is the reference: each section's keys (set or commented
    out) are exactly its Struct's fields; [[te]] lists every engine option."""
    text = (ROOT / "conf" / "node.toml").read_text()
    documented: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        header = re.match(r"^(?:# )?\[\[?(\w+)\]\]?", line)
        if header:
            section = header[1]
            continue
        key = re.match(r"^#?\s*(\w+)\s*=", line)
        if key and section is not None:
            documented.setdefault(section, set()).add(key[1])
    for name, struct_type in SECTION_TYPES.items():
        if name == "te":
            assert documented[name] <= set(struct_type.__struct_fields__)
            assert {"type", "count", "priority"} <= set(text.split("`")) | documented[name]
            missing = [o for o in ENGINE_OPTIONS if o != "processes" and o not in text]
            assert not missing, missing
        elif name == "model":  # an example, commented out: its own keys, engine options aside
            own = set(struct_type.__struct_fields__) - set(ENGINE_OPTIONS)
            assert own <= documented[name] <= set(struct_type.__struct_fields__)
        else:
            assert documented[name] == set(struct_type.__struct_fields__), name


@pytest.mark.parametrize("body, where", [
    ('model = "m"\ncolour = 1', "[engine] unknown engine option(s) ['colour']"),
    ('model = "m"\nblock_size = 0', "[engine] block_size must be a positive integer, got 0"),
    ("tp = 1", '[engine] needs model = "PATH"'),
])
def test_engine_files_name_file_section_and_key(tmp_path, body, where):
    path = tmp_path / "engine.toml"
    path.write_text(f"[engine]\n{body}\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and where in str(info.value)


@pytest.mark.parametrize("value, tp, ok", [
    (0, 2, True), (1, 1, True), (MAX_KV_LOAD_LAYERS, 1, True), (MAX_KV_LOAD_LAYERS + 1, 1, False),
    (-1, 1, False), (True, 1, False), (2.0, 1, False), (1, 2, False)])
def test_kv_load_layers_at_and_past_its_bounds(value, tp, ok):
    """0 is off (any tp); 1..MAX layers of staging, at tp 1 only."""
    options = dict(kv_load_layers=value, tp=tp, processes=True)
    if ok:
        assert EngineConfig(model="m", **options).kv_load_layers == value
    else:
        with pytest.raises(ValueError, match="kv_load_layers"):
            EngineConfig(model="m", **options)


@pytest.mark.parametrize("value, ok", [(0, True), (1, True), (256, True), (257, False),
                                       (-1, False), (True, False), (64.0, False)])
def test_light_step_tokens_at_and_past_its_bounds(value, ok):
    """0 is off; 1..max_num_batched_tokens (256 here) a light-tenant step's budget."""
    options = dict(light_step_tokens=value, max_num_batched_tokens=256)
    if ok:
        assert EngineConfig(model="m", **options).light_step_tokens == value
    else:
        with pytest.raises(ValueError, match="light_step_tokens"):
            EngineConfig(model="m", **options)


@pytest.mark.parametrize("value, dtype, ok", [
    ("", None, True), ("int8", None, True), ("int8", "bfloat16", True), ("int4", None, True),
    ("gguf", None, True), ("gguf", "float32", False), ("GGUF", None, False), ("int3", None, False), ("INT8", None, False), ("int8", "float32", False),
    ("int4", "float16", False)])
def test_quantize_takes_its_modes_on_a_bf16_model_only(value, dtype, ok):
    if ok:
        assert EngineConfig(model="m", quantize=value, dtype=dtype).quantize == value
    else:
        with pytest.raises(ValueError, match="quantize"):
            EngineConfig(model="m", quantize=value, dtype=dtype)


@pytest.mark.parametrize("size, hop, ok", [
    (0, "auto", True), (1, "auto", True), (1, "stream", True), (0, "stream", False),
    (-1, "auto", False), (True, "auto", False), (1.0, "auto", False), (1, "host", False),
    (1, "", False)])
def test_kv_stream_bytes_and_dualpath_hop_at_and_past_their_bounds(size, hop, ok):
    """Streams need buffer bytes (0: none); the hop is auto or stream."""
    options = dict(kv_stream_bytes=size, dualpath_hop=hop)
    if ok:
        assert EngineConfig(model="m", **options).kv_stream_bytes == size
    else:
        with pytest.raises(ValueError, match="kv_stream_bytes|dualpath_hop"):
            EngineConfig(model="m", **options)


@pytest.mark.slow
def test_real_job_executor_uses_max_attempts_and_reports_migrations(tmp_path, tiny_model):
    """[node] max_attempts = 2 in a real JE process started as the node starts
    it: attempt 1 resumes on a TE (and the JE's ActorLife reports
    request_migrated to the supervisor), attempt 2 is refused."""
    from deepserve.ipc.heartbeat import ENV_VAR as HEARTBEAT_ENV
    from deepserve.ipc.sockets import PubSocket, PullSocket, PushSocket
    from deepserve.messages.control import TEInfo, TEList
    from deepserve.messages.engine import AbortRequest, RequestFailed, SubmitRequest, ToClient
    from deepserve.messages.health import HealthEvent, Ready, ToSupervisor
    from deepserve.messages.sampling import SamplingParams

    conf = write_toml(tmp_path, {"node": {"model": str(tiny_model), "max_attempts": 2},
                                 "te": [{}]})
    resolved = resolve(conf, tmp_path)
    run = RunAddresses.in_dir(tmp_path, "run1", ["te0"])
    ctx = zmq.Context()
    cm = PubSocket(ctx, run.cm_pub, bind=True)
    supervisor = PullSocket(ctx, run.hb, bind=True, type=ToSupervisor)
    te = PullSocket(ctx, run.tes["te0"], bind=True, type=SubmitRequest | AbortRequest)
    gw = PullSocket(ctx, run.gw_reply, bind=True, type=ToClient)
    to_je = PushSocket(ctx, run.je, bind=False)
    je = subprocess.Popen([sys.executable, "-m", "deepserve.control.je.job_executor", "--conf",
                           str(resolved), "--role", "job-executor", "--parent-pid",
                           str(os.getpid())], env={**os.environ, HEARTBEAT_ENV: run.hb})
    heard: list = []

    def until(pred, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            heard.extend(supervisor.drain() or [])
            got = pred()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out; the supervisor heard {heard}")

    def submit(attempt):
        to_je.put(SubmitRequest(request_id=f"r{attempt}", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=2), reply_to=run.gw_reply,
                                attempt=attempt))
    try:
        until(lambda: any(isinstance(m, Ready) and m.component == "job-executor" for m in heard))
        info = TEInfo(te_id="te0", model="m", address=run.tes["te0"])

        def routed():
            cm.put(TEList(tes=[info]))
            submit(1)
            return te.drain()
        task = until(routed)[0]
        assert task.attempt == 1
        until(lambda: [m for m in heard if isinstance(m, HealthEvent)
                       and m.event == "request_migrated" and m.details["attempt"] == 1])
        submit(2)
        [failed] = until(gw.drain)
        assert isinstance(failed, RequestFailed) and failed.error == "engine_dead"
        assert "after 2 attempts" in failed.message
    finally:
        je.terminate()
        assert je.wait(15) == 0
        for sock in (cm, supervisor, te, gw, to_je):
            sock.close()
        ctx.term()


def test_command_line_models_replace_the_node_model(tmp_path):
    """--model [NAME=]DIR and --scale-to-zero-after over a file (node_config.with_models)."""
    conf = write_toml(tmp_path, {"node": {"model": "models/m"},
                                 "te": [{"count": 2, "kv_cache_memory": 1 << 20}],
                                 "model": [{"path": "models/x", "min_tes": 0}]})
    config = load_node_config(conf)
    assert with_models(config) is config
    assert [(m.name, m.scalable) for m in config.all_models] == [("m", False), ("x", True)]
    both = with_models(config, [str(tmp_path / "a"), f"bee={tmp_path / 'b'}"], 30.0)
    assert [m.name for m in both.all_models] == ["a", "bee", "x"] and not both.tes
    assert [m.path for m in both.models[:2]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert all(m.idle_s == 30.0 and m.scalable for m in both.all_models)
    assert both.models[0].options == {"kv_cache_memory": 1 << 20}
    assert (both.models[0].min_tes, both.models[0].max_tes, both.models[2].min_tes) == (1, 2, 0)
    assert both.initial_scaled_tes() == {"a-0": "a", "bee-0": "bee"}
    zero = with_models(config, idle_s=5.0)
    assert [(m.name, m.min_tes, m.max_tes, m.idle_s) for m in zero.models] == [
        ("m", 2, 2, 5.0), ("x", 0, 2, 5.0)]
    with pytest.raises(ValueError, match="named alike"):
        with_models(config, [str(tmp_path / "x")])


def test_command_line_quantize_reaches_every_te_and_model(tmp_path):
    """--quantize MODE (node_config.with_quantize): every [[te]] and [[model]] TE's
    engine config says it; a TE whose dtype cannot be quantized is refused."""
    conf = write_toml(tmp_path, {"node": {"model": "models/m"},
                                 "te": [{"count": 2, "kv_cache_memory": 1 << 20}],
                                 "model": [{"path": "models/x", "min_tes": 0}]})
    config = load_node_config(conf)
    assert with_quantize(config, None) is config
    q = with_quantize(config, "int8")
    assert [te.engine_config(q.node.model).quantize for te in q.tes] == ["int8", "int8"]
    assert q.models[0].engine_config().quantize == "int8"
    assert q.tes[0].options["kv_cache_memory"] == 1 << 20  # the rest kept
    with pytest.raises(ValueError, match="quantize must be"):
        with_quantize(config, "int3")
    f32 = write_toml(tmp_path, {"node": {"model": "models/m"}, "te": [{"dtype": "float32"}]})
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        with_quantize(load_node_config(f32), "int8")


def test_a_te_of_the_node_model_keeps_its_table_when_a_pool_process_becomes_it(tmp_path):
    """A pre-warmed process replacing te0 is told te0's model: te0's [[te]] table
    (type, options) still decides what it is."""
    conf = write_toml(tmp_path, {"node": {"model": "models/m"},
                                 "te": [{"type": "decode", "block_size": 32}],
                                 "model": [{"path": "models/x", "block_size": 64}]})
    resolved = resolve(conf, tmp_path)
    for te_id, model, kind, block in (("te0", "m", "decode", 32), ("x-3", "x", "colocated", 64)):
        args = parse_child_args(["--conf", str(resolved), "--role", "te", "--te-id", te_id,
                                 "--model", model], "te", "")
        s = te_server.load_settings(args)
        assert (s.te_type, s.engine.block_size, s.served_model) == (kind, block, model)
        assert s.engine.num_threads == max(1, (os.cpu_count() or 1) // 3)  # te0 + x's 2
        assert s.inbox.endswith(f"/{te_id}.sock")


@pytest.mark.parametrize("tables, cores, want", [
    ({"te": [{"count": 2}]}, 2, [1, 1]),  # the default conf/node.toml on 2 cores
    ({"te": [{"count": 2}]}, 16, [8, 8]),
    ({"te": [{"count": 2}]}, 1, [1, 1]),  # never below one a device
    ({"te": [{"count": 1, "tp": 2}, {"count": 1}]}, 12, [8, 4]),  # 3 devices: 4 cores each
    ({"te": [{"count": 2, "num_threads": 3}]}, 2, [3, 3]),  # said: kept
    ({"node": {"num_devices": 4}, "te": [{"count": 1}]}, 16, [4]),  # room for 4 TEs
    ({"te": [{"count": 1}], "model": [{"path": "models/x", "max_tes": 3}]}, 8, [2, 2]),
])
def test_a_te_without_num_threads_gets_its_share_of_the_cores(tmp_path, tables, cores, want):
    """te_server.cores_share: TEs whose threads outnumber the cores starve each other."""
    conf = write_toml(tmp_path, {"node": {"model": "models/m", **tables.get("node", {})},
                                 **{k: v for k, v in tables.items() if k != "node"}})
    config = load_node_config(conf)
    engines = [te.engine_config(config.node.model) for te in config.tes]
    engines += [m.engine_config() for m in config.models]
    assert [te_server.cores_share(e, config, cores).num_threads for e in engines] == want


@pytest.mark.parametrize("table, ok", [
    ({"min_tes": 0}, True), ({"min_tes": -1}, False),
    ({"min_tes": 64, "max_tes": 64}, True), ({"min_tes": 65, "max_tes": 64}, False),
    ({"max_tes": 1}, True), ({"max_tes": 0}, False), ({"max_tes": 65}, False),
    ({"min_tes": 3, "max_tes": 2}, False),
    ({"slo": {"percentile": 1.0}}, True), ({"slo": {"percentile": 1.01}}, False),
    ({"slo": {"percentile": 0.0}}, False), ({"idle_s": 0.0}, False), ({"idle_s": 0.1}, True),
])
def test_model_table_limits_at_and_past_their_boundary(tmp_path, table, ok):
    path = write_toml(tmp_path, {"model": [{"path": "models/x", **table}]})
    if ok:
        assert load_node_config(path).models[0].path == at(tmp_path, "models/x")
        return
    with pytest.raises(ValueError, match=r"\[\[model\]\]"):
        load_node_config(path)


@pytest.mark.parametrize("key, good, bad", [("pool_size", 64, 65), ("pool_size", 0, -1),
                                            ("weight_cache_bytes", 0, -1),
                                            ("queue_timeout_s", 0.001, 0.0)])
def test_scaling_limits_at_and_past_their_boundary(tmp_path, key, good, bad):
    base = {"node": {"model": "m"}, "te": [{}]}
    assert getattr(load_node_config(write_toml(tmp_path, {**base, "scaling": {key: good}}))
                   .scaling, key) == good
    with pytest.raises(ValueError, match=rf"\[scaling\] {key}"):
        load_node_config(write_toml(tmp_path, {**base, "scaling": {key: bad}}))


def test_cluster_section_checks_its_values_and_derives_the_addresses(tmp_path):
    """[cluster]: wildcards, a malformed head, a joining node without its own
    address, odd names and ports are errors naming the key; a head may have no
    TE; a joining node's TEs are named after it (again when the command line
    renames it) and point at the head's sockets; same-host sockets stay ipc."""
    for host in ("0.0.0.0", "::", "*"):
        with pytest.raises(ValueError, match="wildcard"):
            ClusterSection(insecure=True, host=host)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1")
    with pytest.raises(ValueError, match="needs host"):
        ClusterSection(head="10.0.0.1:7400")
    with pytest.raises(ValueError, match="letters, digits"):
        ClusterSection(insecure=True, host="10.0.0.2", name="a/b")
    for port in (1023, 60001):
        with pytest.raises(ValueError, match=r"\[cluster\] port"):
            load_node_config(write_toml(tmp_path, {**BASE, "cluster": {"host": "h", "port": port, "insecure": True}}))
    assert ClusterSection(insecure=True, host="10.0.0.2", port=1024).port == 1024
    for port in (1024, 60000):  # both ends accepted through the loader's checks too
        conf = write_toml(tmp_path, {**BASE, "cluster": {"host": "h", "port": port, "insecure": True}})
        assert load_node_config(conf).cluster.port == port
    assert ClusterSection(insecure=True, host="h", port=60000).te_port(1381) == 65532  # its 4 ports fit
    with pytest.raises(ValueError, match=r"would need port"):
        ClusterSection(insecure=True, host="h", port=60000).te_port(1382)
    head = NodeConfig.build(model="/m", cluster=ClusterSection(insecure=True, host="10.0.0.1"))
    assert not head.tes and [(m.name, m.min_tes) for m in head.all_models] == [("m", 0)]
    with pytest.raises(ValueError, match="at least one"):
        NodeConfig.build(model="/m")
    with pytest.raises(ValueError, match="joining node runs"):
        NodeConfig.build(model="/m", tes=[TESpec("te0", "colocated")],
                         cluster=ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1:7400"),
                         models=[ModelSpec(name="x", path="/x")])
    joined = NodeConfig.build(model="/m", tes=[TESpec("te0", "colocated"), TESpec("te1", "decode")],
                              cluster=ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1:7400"))
    assert [te.te_id for te in joined.tes] == ["n10-0-0-2-te0", "n10-0-0-2-te1"]
    renamed = with_cluster(joined, name="h2")
    assert [te.te_id for te in renamed.tes] == ["h2-te0", "h2-te1"]
    keyed = with_cluster(renamed, keys="/etc/ds-keys")  # --keys DIR: nothing else changes
    assert keyed.cluster.keys == "/etc/ds-keys" and keyed.tes == renamed.tes
    assert msgspec.structs.replace(keyed.cluster, keys=renamed.cluster.keys) == renamed.cluster
    run = RunAddresses.for_node(tmp_path, "r", [te.te_id for te in renamed.tes], True,
                                renamed.cluster)
    assert (run.cm, run.cm_pub, run.gw_reply, run.je) == (
        "tcp://10.0.0.1:7400", "tcp://10.0.0.1:7401", "tcp://10.0.0.1:7403", "")
    assert run.tes == {"h2-te0": "tcp://10.0.0.2:7408", "h2-te1": "tcp://10.0.0.2:7412"}
    assert run.hb.startswith("ipc://") and run.kv_cache.startswith("ipc://")
    assert run.node_inbox == "tcp://10.0.0.2:7404"  # the head's CM sends ScaleOut here
    head_run = RunAddresses.for_node(tmp_path, "r", [], False, ClusterSection(insecure=True, host="10.0.0.1"))
    assert head_run.node_inbox == ""  # the CM is on the head: its heartbeat inbox
    assert (run.weights, head_run.weights) == ("tcp://10.0.0.2:7405", "tcp://10.0.0.1:7406")
    assert (run.kv_peer, head_run.kv_peer) == ("tcp://10.0.0.2:7407", "")  # the remote tier
    single = RunAddresses.for_node(tmp_path, "r", ["te0"], False, ClusterSection())
    assert single == RunAddresses.in_dir(tmp_path, "r", ["te0"]) and single.weights == ""
    with pytest.raises(ValueError, match="wildcard"):
        with_cluster(joined, host="0.0.0.0")
    for host in ("0.0.0.0", ""):  # a KV receiver other hosts reach binds a real address
        with pytest.raises(ValueError, match="kv_bind_host"):
            EngineConfig("/m", kv_bind_host=host)


def test_standby_heads_list_every_head_and_bind_their_own_first(tmp_path):
    """`head` takes several HOST:PORT (the head, then standby heads); each must
    be well formed, listed once, and not this node. A standby joins a head and
    its head sockets list itself first (it binds them on take-over, ipc/sockets.py);
    a plain node connects to every head; the command line keeps the file's
    other [cluster] keys (secure and keys included)."""
    for head in ("10.0.0.1:7400,10.0.0.3", "10.0.0.1:7400,:7400", "10.0.0.1:7400,,x:1",
                 "10.0.0.1:0", "10.0.0.1:65536"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            ClusterSection(insecure=True, host="10.0.0.2", head=head)
    assert ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1:65535").heads == [("10.0.0.1", 65535)]
    with pytest.raises(ValueError, match="named twice"):
        ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1:7400,10.0.0.1:7400")
    with pytest.raises(ValueError, match="is this node"):
        ClusterSection(insecure=True, host="10.0.0.2", head="10.0.0.1:7400,10.0.0.2:7400", standby=True)
    # a node on the head's host with the head's port (as Ray's fabric starts one) joins it
    assert ClusterSection(insecure=True, host="10.0.0.1", head="10.0.0.1:7400").heads == [("10.0.0.1", 7400)]
    with pytest.raises(ValueError, match="standby: a standby head joins"):
        ClusterSection(insecure=True, host="10.0.0.2", standby=True)
    for bad in (0.49, 600.1):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"host": "h", "failover_s": bad}, ClusterSection)
    for ok in (0.5, 600):
        assert msgspec.convert({"host": "h", "failover_s": ok}, ClusterSection).failover_s == ok
    node = ClusterSection(insecure=True, host="10.0.0.3", head="10.0.0.1:7400,10.0.0.2:7500")
    run = RunAddresses.for_node(tmp_path, "r", ["n-te0"], False, node)
    assert run.cm == "tcp://10.0.0.1:7400,tcp://10.0.0.2:7500" and run.je == ""
    assert run.cm_pub == "tcp://10.0.0.1:7401,tcp://10.0.0.2:7501"
    standby = ClusterSection(insecure=True, host="10.0.0.2", port=7500, head="10.0.0.1:7400", standby=True)
    run = RunAddresses.for_node(tmp_path, "r", [], False, standby)
    assert (run.cm, run.je, run.gw_reply, run.node_inbox) == (
        "tcp://10.0.0.2:7500,tcp://10.0.0.1:7400", "tcp://10.0.0.2:7502,tcp://10.0.0.1:7402",
        "tcp://10.0.0.2:7503", "tcp://10.0.0.2:7504")
    scaled = ModelSpec(name="x", path="/x", min_tes=2)
    with pytest.raises(ValueError, match="joining node runs"):  # a plain node: the head's
        NodeConfig.build(model="/m", cluster=ClusterSection(insecure=True, host="10.0.0.3",
                                                             head="10.0.0.1:7400"),
                         tes=[TESpec("te0", "colocated")], models=[scaled])
    mirror = NodeConfig.build(model="/m", cluster=standby, models=[scaled],
                              tes=[TESpec("te0", "colocated")])
    assert "x" in mirror.served_models and mirror.initial_scaled_tes() == {}  # none started
    secure = NodeConfig.build(model="/m", tes=[TESpec("te0", "colocated")], cluster=ClusterSection(
        host="10.0.0.2", secure=True, keys="/k", failover_s=9.0))
    joined = with_cluster(secure, join="10.0.0.1:7400", standby=True)
    assert (joined.cluster.secure, joined.cluster.keys, joined.cluster.failover_s,
            joined.cluster.standby) == (True, "/k", 9.0, True)


def test_cluster_secure_needs_a_host_and_resolves_its_keys_against_the_root(tmp_path):
    """secure = true on one host is an error (nothing crosses hosts); keys, set
    or left at its default, is an absolute path under the repository root; a
    node whose keys are missing or readable by others refuses to start."""
    with pytest.raises(ValueError, match="secure: needs host"):
        ClusterSection(secure=True)
    conf = write_toml(tmp_path, {**BASE, "cluster": {"host": "h", "secure": True}})
    root = Path(conf).resolve().parent.parent
    assert load_node_config(conf).cluster.keys == str(root / "var" / "keys")
    conf = write_toml(tmp_path, {**BASE, "cluster": {"host": "h", "secure": True,
                                                     "keys": "etc/k"}})
    assert load_node_config(conf).cluster.keys == str(root / "etc" / "k")
    curve_keys.make_keys(tmp_path / "k")
    curve_keys.make_node_key(tmp_path / "k", "n10-0-0-1")
    os.chmod(tmp_path / "k" / "cluster.key_secret", 0o640)
    config = NodeConfig.build(model="/m", cluster=ClusterSection(
        host="10.0.0.1", secure=True, keys=str(tmp_path / "k")))
    with pytest.raises(curve_keys.KeysError, match="chmod 600"):
        Node(config)
    assert curve.ENV_VAR not in os.environ  # refused before it touched the process


def test_deepserve_keys_makes_the_cluster_pair_and_node_keys_once_and_revokes(tmp_path):
    from click.testing import CliRunner

    from deepserve.supervisor.keys_cli import main
    k = tmp_path / "k"
    made = CliRunner().invoke(main, [str(k)])
    assert made.exit_code == 0 and "--node NAME" in made.output, made.output
    assert (k / "cluster.key_secret").stat().st_mode & 0o777 == 0o600 and (k / "allowed").is_dir()
    again = CliRunner().invoke(main, [str(k)])
    assert again.exit_code == 1 and "already holds a cluster key" in again.output
    head = CliRunner().invoke(main, [str(k), "--node", "h0", "--head"])
    assert head.exit_code == 0 and "(head)" in head.output, head.output
    assert CliRunner().invoke(main, [str(k), "--node", "n1"]).exit_code == 0
    assert (k / "n1.key_secret").stat().st_mode & 0o777 == 0o600
    allowed = curve_keys.AllowList(k)
    assert allowed.member(curve_keys.Keys.load(k, "h0").node_public) == ("h0", "head")
    assert allowed.member(curve_keys.Keys.load(k, "n1").node_public) == ("n1", "")
    bad = CliRunner().invoke(main, [str(k), "--node", "../x"])
    assert bad.exit_code == 1 and "node name" in bad.output
    assert CliRunner().invoke(main, [str(k), "--revoke", "n1"]).exit_code == 0
    assert allowed.member(curve_keys.Keys.load(k, "n1").node_public) is None
    gone = CliRunner().invoke(main, [str(k), "--revoke", "n1"])
    assert gone.exit_code == 1 and "not on" in gone.output


@pytest.mark.parametrize("host", ["10.0.0.1", "node1.example", "::ffff:10.0.0.1"])
def test_sockets_beyond_loopback_need_keys_or_insecure(host):
    """A cluster host others reach without secure, or a gateway beyond loopback
    without api_keys, is refused unless [cluster] insecure says so; loopback
    (127.0.0.0/8, ::1, localhost) needs neither."""
    te = [TESpec("te0", "colocated")]
    with pytest.raises(ValueError, match="secure = true with keys"):
        NodeConfig.build(model="/m", tes=te, cluster=ClusterSection(host=host))
    with pytest.raises(ValueError, match="gateway listens beyond this host"):
        NodeConfig.build(model="/m", tes=te, host=host)
    opened = NodeConfig.build(model="/m", tes=te, host=host,
                              cluster=ClusterSection(host=host, insecure=True))
    assert opened.insecure_sockets == [f"cluster sockets on {host} without CURVE",
                                       f"gateway on {host}:8000 without api_keys"]
    keyed = NodeConfig.build(model="/m", tes=te, host=host, api_keys={"k": "t"},
                             cluster=ClusterSection(host=host, secure=True))
    assert keyed.insecure_sockets == []
    for loop in ("127.0.0.2", "::1", "localhost"):
        assert NodeConfig.build(model="/m", tes=te, host=loop,
                                cluster=ClusterSection(host=loop)).insecure_sockets == []
    with pytest.raises(ValueError, match="choose one"):
        ClusterSection(host=host, secure=True, insecure=True)


def test_k8s_manifest_opens_the_ports_the_cluster_binds():
    """conf/k8s/raycluster.yaml (validated once against KubeRay's CRD schema,
    conf/k8s/README.md): the pods expose the [cluster] ports our nodes bind
    by default, mount an in-memory /dev/shm, and pin the Ray the extra installs."""
    yaml = pytest.importorskip("yaml")
    raycluster, service = yaml.safe_load_all((ROOT / "conf" / "k8s" / "raycluster.yaml").read_text())
    assert (raycluster["apiVersion"], raycluster["kind"]) == ("ray.io/v1", "RayCluster")
    c = ClusterSection(insecure=True, host="10.0.0.1")
    head = raycluster["spec"]["headGroupSpec"]["template"]["spec"]
    [worker_group] = raycluster["spec"]["workerGroupSpecs"]
    worker = worker_group["template"]["spec"]
    ports = lambda pod: {p["containerPort"] for p in pod["containers"][0]["ports"]}  # noqa: E731
    assert {c.port, c.port + 1, c.port + 2, c.port + 3, c.te_port(0), 8000, 6379} <= ports(head)
    assert {c.te_port(0), c.te_port(0) + 1} <= ports(worker)
    for pod in (head, worker):
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
        assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert service["spec"]["ports"][0]["targetPort"] == NodeSection().port
    head_labels = raycluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= head_labels.items()
    # keys: the head pod only, from a Secret copied into a writable [cluster] keys directory
    volumes = {v["name"]: v for v in head["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts["keys"] == "/opt/deepserve/" + ClusterSection().keys
    assert volumes["keys-secret"]["secret"]["secretName"] == "deepserve-keys"
    [init] = head["initContainers"]
    assert {m["name"] for m in init["volumeMounts"]} == {"keys", "keys-secret"}
    assert "chmod 600 /keys/*.key_secret" in init["command"][-1]
    assert volumes["head-conf"]["secret"]["secretName"] == "deepserve-head-conf"
    assert not {v["name"] for v in worker["volumes"]} & {"keys", "keys-secret", "head-conf"}
    for name in ("cluster-head", "cluster-node", "cluster-scaled-head", "cluster-scaled-node"):
        assert load_node_config(ROOT / "conf" / f"{name}.toml").cluster.secure, name
