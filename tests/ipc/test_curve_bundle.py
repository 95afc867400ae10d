"""Key bundles (ipc/curve_keys.py node_bundle / write_bundle): what the Ray fabric
hands a joining host, written where that host's node reads it."""

from __future__ import annotations

import pytest

from deepserve.ipc import curve_keys
from deepserve.ipc.curve_keys import Keys, KeysError


def test_a_node_bundle_makes_the_pair_once_and_loads_on_the_other_side(tmp_path):
    src = tmp_path / "src"
    curve_keys.make_keys(src)
    curve_keys.make_node_key(src, "head", head=True)
    bundle = curve_keys.node_bundle(src, "n10-0-0-2")
    assert (src / "allowed" / "n10-0-0-2.key").is_file()  # on the fabric's list too
    assert curve_keys.node_bundle(src, "n10-0-0-2") == bundle  # the same pair again
    assert "head.key_secret" not in bundle and "n10-0-0-2.key_secret" in bundle
    host = tmp_path / "host"
    curve_keys.write_bundle(host, bundle)
    keys = Keys.load(host, "n10-0-0-2")
    assert keys.node == "n10-0-0-2" and keys.public == Keys.load(src, "head").public
    assert (host.stat().st_mode & 0o777, (host / "n10-0-0-2.key_secret").stat().st_mode & 0o777,
            (host / "cluster.key_secret").stat().st_mode & 0o777) == (0o700, 0o600, 0o600)
    assert curve_keys.AllowList(host).member(
        Keys.load(src, "head").node_public) == ("head", "head")


def test_an_allow_list_bundle_replaces_the_list_revoked_keys_included(tmp_path):
    src, host = tmp_path / "src", tmp_path / "host"
    curve_keys.make_keys(src)
    for name in ("a", "b"):
        curve_keys.make_node_key(src, name)
    curve_keys.write_bundle(host, curve_keys.node_bundle(src, "a"))
    assert {p.stem for p in (host / "allowed").glob("*.key")} == {"a", "b"}
    curve_keys.revoke(src, "b")
    assert curve_keys.write_bundle(host, curve_keys.allowed_bundle(src)) is None
    assert {p.stem for p in (host / "allowed").glob("*.key")} == {"a"}
    assert (host / "a.key_secret").is_file()  # the node's own pair stays


@pytest.mark.parametrize("rel", ["../x.key", "allowed/../../x.key", "sub/x.key", "x.txt",
                                 "allowed/bad name.key", "/etc/x.key"])
def test_a_bundle_writes_key_files_in_its_directory_only(tmp_path, rel):
    with pytest.raises(KeysError, match="not a key file name"):
        curve_keys.write_bundle(tmp_path / "host", {rel: b"x"})
    assert not (tmp_path / "x.key").exists() and not (tmp_path / "x.txt").exists()
