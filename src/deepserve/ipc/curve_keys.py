"""The key files of a secure cluster (`[cluster] keys = DIR`), made by bin/deepserve-keys:

    DIR/cluster.key, cluster.key_secret   the cluster's server pair: every member's bound
                                          tcp:// socket presents it, every member's client
                                          checks it (a server without it is not ours)
    DIR/NAME.key, NAME.key_secret         node NAME's own pair: its identity as a client
                                          (its [cluster] name); only NAME's host needs
                                          the secret half
    DIR/allowed/NAME.key                  the allow-list: a client is admitted only with
                                          one of these public keys, and is known by its
                                          file's NAME (ZAP's user id); `role = head` in
                                          its metadata marks a head or standby head

A node is revoked by removing its allowed/ file (bin/deepserve-keys DIR --revoke
NAME) on every host: from then on no member admits a connection with its key.
The list is read again whenever a file in allowed/ changes, so no restart is needed.
Secret files are 0600 and a secret readable by others is refused.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

CLUSTER = "cluster"
ALLOWED = "allowed"
HEAD = "head"
"""The role of a head's (or standby head's) key: the one a node takes orders from."""
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ROLE = re.compile(rb"^\s+role\s*=\s*\"?([A-Za-z]+)\"?\s*$", re.MULTILINE)


class KeysError(ValueError):
    """The cluster keys are missing, malformed, or readable by others."""


def _check_name(name: str) -> str:
    if not _NAME.match(name) or name == CLUSTER:
        raise KeysError(f"node name {name!r}: 1-64 letters, digits, - and _ "
                        f"(and not {CLUSTER!r})")
    return name


def _pair(d: Path, name: str, hint: str) -> tuple[bytes, bytes]:
    """(public, secret) of d/name.key_secret, checked: present, 0600, well formed."""
    public_file, secret_file = d / f"{name}.key", d / f"{name}.key_secret"
    if not secret_file.is_file():
        raise KeysError(f"{secret_file}: missing; {hint}")
    mode = secret_file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"{secret_file}: readable by others (mode {oct(mode & 0o777)}); "
                        f"chmod 600 it")
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
        if public_file.is_file() and zmq.auth.load_certificate(public_file)[0] != public:
            raise KeysError(f"{public_file}: not the public half of {secret_file}")
    except (OSError, ValueError) as e:  # KeysError is a ValueError: re-raised as is
        raise e if isinstance(e, KeysError) else KeysError(f"{secret_file}: {e}") from None
    if not secret or len(public) != 40 or len(secret) != 40:
        raise KeysError(f"{secret_file}: not a CURVE key pair")
    return public, secret


@dataclass(frozen=True)
class Keys:
    """What a secure process holds (Z85, as ZeroMQ takes them): the cluster's
    server pair, its node's own pair, and where the allow-list is."""

    public: bytes
    secret: bytes
    node: str
    node_public: bytes
    node_secret: bytes
    directory: Path

    @classmethod
    def load(cls, directory: str | Path, node: str) -> Keys:
        d = Path(directory)
        public, secret = _pair(d, CLUSTER, f"make the cluster's with bin/deepserve-keys {d} "
                                           f"and copy it to every host")
        node_public, node_secret = _pair(d, _check_name(node),
                                         f"make this node's with bin/deepserve-keys {d} "
                                         f"--node {node}")
        if not (d / ALLOWED).is_dir():
            raise KeysError(f"{d / ALLOWED}: no allow-list directory (bin/deepserve-keys "
                            f"{d} makes it)")
        return cls(public, secret, node, node_public, node_secret, d.resolve())


class AllowList:
    """The admitted public keys of DIR/allowed (see the module doc), read again
    when any of its files changes. Thread-safe (the guard thread reads it)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory) / ALLOWED
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._members: dict[bytes, tuple[str, str]] = {}  # public key -> (name, role)

    def member(self, public: bytes) -> tuple[str, str] | None:
        """(name, role) of the node whose allowed key is `public` (Z85), or None."""
        with self._lock:
            stamp = self._read_stamp()
            if stamp != self._stamp:
                self._members, self._stamp = self._load(), stamp
            return self._members.get(public)

    def _read_stamp(self) -> tuple:
        try:
            stats = [(e.name, e.stat()) for e in os.scandir(self.dir)]
        except OSError:  # no directory (or a file gone meanwhile): read it next time
            return ()
        return tuple(sorted((name, st.st_mtime_ns, st.st_size) for name, st in stats))

    def _load(self) -> dict[bytes, tuple[str, str]]:
        members = {}
        for path in sorted(self.dir.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
                role = _ROLE.search(path.read_bytes())
            except (OSError, ValueError):
                continue  # a damaged or half-copied file admits nobody
            if public and _NAME.match(path.stem):
                members[public] = (path.stem, role.group(1).decode() if role else "")
        return members


def make_keys(directory: str | Path) -> Path:
    """The cluster's server pair and an empty allow-list in `directory` (made if
    missing; an existing pair is an error: replacing it locks every host out)."""
    d = Path(directory)
    if (d / f"{CLUSTER}.key_secret").exists():
        raise KeysError(f"{d}: already holds a cluster key; remove it first to make a new one")
    return _make(d, CLUSTER, None)


def make_node_key(directory: str | Path, name: str, head: bool = False) -> Path:
    """Node `name`'s pair in `directory`, its public half on the allow-list
    (with role = head for a head or standby head). An existing one is an error."""
    d = Path(directory)
    if (d / f"{_check_name(name)}.key_secret").exists() or (d / ALLOWED / f"{name}.key").exists():
        raise KeysError(f"{d}: already holds a key for node {name!r}; revoke it first")
    secret_file = _make(d, name, {"role": HEAD} if head else None)
    public_text = "".join(line for line in secret_file.read_text().splitlines(keepends=True)
                          if "secret-key" not in line)
    allowed = d / ALLOWED / f"{name}.key"
    with tempfile.NamedTemporaryFile("w", dir=d / ALLOWED, delete=False) as f:
        f.write(public_text)
    os.replace(f.name, allowed)
    os.chmod(allowed, 0o644)
    return secret_file


def node_bundle(directory: str | Path, name: str) -> dict[str, bytes]:
    """What node `name`'s host needs, as {relative path: content}: the cluster's
    pair, the node's own pair (made here first if it has none) and the allow-list.
    The Ray fabric hands it to the node's agent (write_bundle there)."""
    d = Path(directory)
    if not (d / f"{_check_name(name)}.key_secret").exists():
        make_node_key(d, name)
    files = [f"{CLUSTER}.key", f"{CLUSTER}.key_secret", f"{name}.key", f"{name}.key_secret"]
    return {**{f: (d / f).read_bytes() for f in files}, **allowed_bundle(d)}


def allowed_bundle(directory: str | Path) -> dict[str, bytes]:
    """The allow-list of `directory` as {allowed/NAME.key: content}."""
    return {f"{ALLOWED}/{p.name}": p.read_bytes()
            for p in sorted((Path(directory) / ALLOWED).glob("*.key"))}


def write_bundle(directory: str | Path, files: dict[str, bytes]) -> None:
    """Write a node_bundle / allowed_bundle into `directory` (0700, secrets 0600,
    each file whole before it is visible); an allow-list it carries replaces the
    one there (a key it lacks is revoked)."""
    d = Path(directory)
    (d / ALLOWED).mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for rel, content in files.items():
        path = d / rel
        if path.parent not in (d, d / ALLOWED) or not _NAME.match(path.stem) \
                or path.suffix not in (".key", ".key_secret"):
            raise KeysError(f"{rel!r}: not a key file name")
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, delete=False) as f:
            f.write(content)
        os.chmod(f.name, 0o600 if rel.endswith("_secret") else 0o644)
        os.replace(f.name, path)
    if any(rel.startswith(f"{ALLOWED}/") for rel in files):
        for stale in (d / ALLOWED).glob("*.key"):
            if f"{ALLOWED}/{stale.name}" not in files:
                stale.unlink()


def revoke(directory: str | Path, name: str) -> bool:
    """Take node `name` off the allow-list of `directory`; False if it was not on it."""
    try:
        (Path(directory) / ALLOWED / f"{_check_name(name)}.key").unlink()
    except FileNotFoundError:
        return False
    return True


def _make(d: Path, name: str, metadata: dict | None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    (d / ALLOWED).mkdir(exist_ok=True)
    old = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=d) as tmp:  # whole before it is visible
            public, secret = zmq.auth.create_certificates(tmp, name, metadata)
            shutil.move(public, d / f"{name}.key")
            shutil.move(secret, d / f"{name}.key_secret")
    finally:
        os.umask(old)
    os.chmod(d / f"{name}.key_secret", 0o600)
    return d / f"{name}.key_secret"
