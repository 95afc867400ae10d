"""`bin/deepserve-keys DIR [--node NAME [--head] | --revoke NAME]`: the key files of
`[cluster] secure = true` (ipc/curve_keys.py).

    bin/deepserve-keys DIR                   the cluster's server pair, and DIR/allowed/
    bin/deepserve-keys DIR --node NAME       node NAME's own pair, its public half on the
                                             allow-list (--head: a head or standby head,
                                             the only key a node takes orders from)
    bin/deepserve-keys DIR --revoke NAME     NAME off the allow-list: refused from then on

Give every host cluster.key, cluster.key_secret, allowed/ and its own
NAME.key_secret (NAME is its [cluster] name) at the path its conf's `[cluster]
keys` names; keep allowed/ the same on every host (revoke on each). An existing
pair is never overwritten (that would lock every host out).
"""

from __future__ import annotations

from pathlib import Path

import click

from deepserve.ipc import curve_keys

ROOT = Path(__file__).resolve().parents[3]


@click.command()
@click.argument("directory", required=False, default=str(ROOT / "var" / "keys"),
                type=click.Path(file_okay=False))
@click.option("--node", "node", default=None, help="make node NAME's key pair ([cluster] name)")
@click.option("--head", is_flag=True, help="with --node: a head or standby head")
@click.option("--revoke", default=None, help="take node NAME off the allow-list")
def main(directory: str, node: str | None, head: bool, revoke: str | None) -> None:
    """Make the key files in DIRECTORY (default: var/keys, what [cluster] keys names)."""
    try:
        if revoke is not None:
            if not curve_keys.revoke(directory, revoke):
                raise click.ClickException(f"{revoke!r} is not on {directory}'s allow-list")
            click.echo(f"revoked {revoke}: remove allowed/{revoke}.key on every other host too")
        elif node is not None:
            secret = curve_keys.make_node_key(directory, node, head)
            click.echo(f"node {node}{' (head)' if head else ''}: {secret} (secret, 0600; "
                       f"only {node}'s host needs it), allowed/{node}.key on the allow-list")
        else:
            if head:
                raise click.UsageError("--head goes with --node NAME")
            secret = curve_keys.make_keys(directory)
            click.echo(f"cluster key pair: {secret} (secret, 0600), and {directory}/allowed/;\n"
                       f"now one per node: bin/deepserve-keys {directory} --node NAME "
                       f"[--head]; set [cluster] secure = true and keys = \"{directory}\"")
    except curve_keys.KeysError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
