"""`bin/deepserve-keys [DIR]`: make the cluster key pair for `[cluster] secure = true`.

    DIR/cluster.key          the public half
    DIR/cluster.key_secret   both halves, mode 0600 (DIR itself 0700)

Copy DIR to every host of the cluster (the same path as its conf's
`[cluster] keys`); a host without it cannot join, list a TE, inject a message
or pull KV. An existing pair is never overwritten (that would lock every host
out): remove it first to rotate, then restart every node with the new one.
"""

from __future__ import annotations

from pathlib import Path

import click

from deepserve.ipc import curve

ROOT = Path(__file__).resolve().parents[3]


@click.command()
@click.argument("directory", required=False, default=str(ROOT / "var" / "keys"),
                type=click.Path(file_okay=False))
def main(directory: str) -> None:
    """Make the cluster key pair in DIRECTORY (default: var/keys, what [cluster] keys names)."""
    try:
        secret = curve.make_keys(directory)
    except curve.KeysError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"cluster key pair: {secret} (secret, 0600) and {secret.with_suffix('.key')}\n"
               f"copy {Path(directory).resolve()} to every host; set [cluster] secure = true "
               f"and keys = \"{directory}\" in every node's conf")


if __name__ == "__main__":
    main()
