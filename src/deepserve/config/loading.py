"""Reading a node's TOML (conf/*.toml) and writing / reading the resolved
config a node hands its children.

    conf/node.toml --load_node_config--> NodeConfig --(node: + RunAddresses)-->
        <run dir>/node.json (0600) --read_run_config--> every child, which takes its part

Every error names the file, the section and the key:
    conf/x.toml: [supervisor] heartbeat_deadline_s: Expected `float` > 0.0, got -1
Relative paths (model, pd_heatmap, pd_predictor, log_dir) are relative to the
repository root: the folder above conf/.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec

from deepserve.config.models import ModelSpec, model_spec
from deepserve.config.cluster import named_for_cluster
from deepserve.config.tenants import TenantSection, TenantsSection
from deepserve.config.addresses import RunAddresses
from deepserve.private_files import write_private
from deepserve.config.node import _SECTION_TYPES, ENGINE_OPTIONS, NodeConfig, TESpec

_PATHS = {"node": ("model", "disk_cache_dir", "gguf_cache_dir"),
          "router": ("pd_heatmap", "pd_predictor"), "supervisor": ("log_dir",), "model": ("path",),
          "cluster": ("keys", "state_dir")}
"""Keys holding paths, resolved against the repository root."""
_ARRAYS = ("te", "model")
"""Sections written as arrays of tables ([[te]], [[model]])."""


def load_node_config(path: str | Path, overrides: dict | None = None) -> NodeConfig:
    """Read a node's TOML. `overrides`: flat keys (port=..., model=...) that
    win over the file, e.g. from the command line; checked like the file's."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    unknown = sorted(set(raw) - set(_SECTION_TYPES))
    if unknown:
        known = ", ".join(f"[[{s}]]" if s in _ARRAYS else f"[{s}]" for s in _SECTION_TYPES)
        raise ValueError(f"{path}: unknown section(s) {', '.join(f'[{s}]' for s in unknown)}; "
                         f"known: {known}")
    _apply_overrides(raw, overrides or {}, path)
    joins = bool(raw.get("cluster", {}).get("head"))  # capacity only: models come from the head
    if "model" not in raw.get("node", {}) and (raw.get("te") or not (raw.get("model") or joins)):
        raise ValueError(f'{path}: [node] model: required (model = "DIR")')
    root = Path(path).resolve().parent.parent
    parts = {}
    for section in ("node", "gateway", "router", "supervisor", "scaling", "cluster"):
        table = _absolute_paths(section, dict(raw.get(section, {})), root)
        parts[section] = _decode(path, f"[{section}]", table, _SECTION_TYPES[section])
    parts["tenants"] = _tenants(path, dict(raw.get("tenants", {})))
    tes = named_for_cluster(_te_specs(path, raw.get("te", [])), parts["cluster"])
    models = tuple(_model_specs(path, raw.get("model", []), root))
    try:
        return NodeConfig(tes=tes, models=models, **parts)
    except ValueError as e:
        raise ValueError(f"{path}: {_section_of(str(e))}") from None


def _apply_overrides(raw: dict, overrides: dict, path) -> None:
    for key, value in overrides.items():
        owner = [s for s in ("node", "gateway", "router")
                 if key in _SECTION_TYPES[s].__struct_fields__]
        if not owner:
            raise ValueError(f"{path}: override {key!r}: not a [node], [gateway] or [router] key")
        raw.setdefault(owner[0], {})[key] = value


def _absolute_paths(section: str, table: dict, root: Path) -> dict:
    """Relative paths, the file's or a field's default (e.g. [cluster] keys), made absolute."""
    defaults = {}
    if section in _SECTION_TYPES and section not in _ARRAYS:
        defaults = {f.name: f.default for f in msgspec.structs.fields(_SECTION_TYPES[section])}
    for key in _PATHS.get(section, ()):
        value = table.get(key, defaults.get(key))
        if isinstance(value, str) and value and not Path(value).is_absolute():
            table[key] = str(root / value)
    return table


def _te_specs(path, tables) -> list[TESpec]:
    if not isinstance(tables, list):
        raise ValueError(f"{path}: [te]: write TEs as [[te]] tables (an array), not [te]")
    specs: list[TESpec] = []
    for i, table in enumerate(tables):
        te = _decode(path, f"[[te]] #{i + 1}", table, _SECTION_TYPES["te"])
        options = {k: getattr(te, k) for k in table if k in ENGINE_OPTIONS and k != "processes"}
        for _ in range(te.count):
            specs.append(TESpec(f"te{len(specs)}", te.type, options, te.priority))
    return specs


def _model_specs(path, tables, root: Path) -> list[ModelSpec]:
    if not isinstance(tables, list):
        raise ValueError(f"{path}: [model]: write models as [[model]] tables (an array)")
    specs = []
    for i, table in enumerate(tables):
        table = _absolute_paths("model", dict(table), root)
        section = _decode(path, f"[[model]] #{i + 1}", table, _SECTION_TYPES["model"])
        options = {k: getattr(section, k) for k in table
                   if k in ENGINE_OPTIONS and k != "processes"}
        specs.append(model_spec(section, options))
    return specs


def _tenants(path, table: dict) -> TenantsSection:
    """[tenants], each [tenants.named.NAME] decoded on its own: an error names the tenant."""
    named = table.pop("named", {})
    if not isinstance(named, dict) or not all(isinstance(t, dict) for t in named.values()):
        raise ValueError(f"{path}: [tenants] named: write one [tenants.named.NAME] table "
                         "per tenant")
    section = _decode(path, "[tenants]", table, TenantsSection)
    return msgspec.structs.replace(section, named={
        name: _decode(path, f"[tenants.named.{name}]", t, TenantSection)
        for name, t in named.items()})


def _decode(path, where: str, table, struct_type):
    """One section, with the file, section and key in any error."""
    try:
        return msgspec.convert(table, struct_type)
    except msgspec.ValidationError as e:
        text = str(e)
        m = re.fullmatch(r"Object contains unknown field `(.+?)`(?: - at `\$(.*)`)?", text)
        if m:
            inner = [part for part in (m[2] or "").split(".") if part]
            known = ", ".join(sorted(_nested(struct_type, inner).__struct_fields__))
            key = ".".join([*inner, m[1]])
            raise ValueError(f"{path}: {where} {key}: unknown key; known: {known}") from None
        m = re.fullmatch(r"(.*) - at `\$\.(\w+)(.*)`", text)
        if m:
            why = m[1] if "got" in m[1] else f"{m[1]}, got {_value_at(table, m[2] + m[3])!r}"
            raise ValueError(f"{path}: {where} {m[2]}{m[3]}: {why}") from None
        raise ValueError(f"{path}: {where} {text}") from None


def _value_at(table, dotted: str):
    for key in dotted.split("."):
        table = table.get(key) if isinstance(table, dict) else None
    return table


def _nested(struct_type, keys: list[str]):
    """The Struct type at keys inside struct_type ([router] pd_options -> PDOptions)."""
    for key in keys:
        [struct_type] = [f.type for f in msgspec.structs.fields(struct_type) if f.name == key]
    return struct_type


def _section_of(message: str) -> str:
    """NodeConfig's and EngineConfig's own checks ("te: ...", "block_size must
    be ...") as "[[te]] key: ..."."""
    head, _, rest = message.partition(" ")
    if head == "te:":
        return f"[[te]] {rest}"
    if head == "model:":
        return f"[[model]] {rest}"
    if head == "node:":
        return f"[node] {rest}"
    if head == "tenants:":
        return f"[tenants] {rest}"
    if head in ENGINE_OPTIONS:
        return f"[[te]] {head}: {rest}"
    return message


# -- the resolved config a node writes for its children -------------------------------

def write_run_config(config: NodeConfig, path: str | Path) -> Path:
    """Write the resolved config (API keys included) readable by its owner only."""
    if config.run is None:
        raise ValueError("write_run_config needs the run's addresses (NodeConfig.with_run)")
    path = Path(path)  # rewritten at run time (a learned model): never read half-written
    write_private(path, msgspec.json.encode(config))
    return path


def read_run_config(path: str | Path) -> tuple[NodeConfig, RunAddresses]:
    """A child's view of its node: the whole resolved config and the run's addresses."""
    with open(path, "rb") as f:
        config = msgspec.json.decode(f.read(), type=NodeConfig)
    if config.run is None:
        raise ValueError(f"{path}: not a resolved node config (no run addresses)")
    return config, config.run
