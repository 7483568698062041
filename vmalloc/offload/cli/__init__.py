"""``vmalloc offload``: the command line over the offload package (``commands``; the GPU,
profile and validation commands in ``cli_profiles``). The top of the offload folders, reached
from :mod:`vmalloc.cli`."""

from vmalloc.offload.cli.commands import OffloadCliError, add_parser, run, table

__all__ = ["OffloadCliError", "add_parser", "run", "table"]
