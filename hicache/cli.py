"""The `hicache` command: the one place that wires workloads, the core and the drivers.

What each subcommand takes is data (`hicache.commands.table`), made into argparse by a loop
(`hicache.commands.parser`); what each does lives beside it (`hicache.commands.sim_commands`,
`hicache.commands.runtime_commands`). This module parses, runs the chosen command and turns the
errors a user can fix into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hicache.commands.parser import build_parser as _build
from hicache.commands.table import HICACHE
from hicache.core.errors import PolicyError
from hicache.extras import missing_extra
from hicache.scenarios.scenario import ScenarioError
from hicache.scenarios.traces import TraceError


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser, from the table (`hicache.commands.table.HICACHE`)."""
    return _build(HICACHE)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = tuple(sys.argv[1:] if argv is None else argv)  # a TP node's rank 0 starts the others with it
    try:
        return args.handler(args)
    except (ScenarioError, TraceError, PolicyError, ValueError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional extra this command needs is not installed
        if (line := missing_extra(exc)) is None:
            raise
        print(f"hicache {args.command}: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling of it (or without one)
        print(f"hicache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
