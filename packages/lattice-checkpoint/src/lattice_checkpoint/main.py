"""``lattice-checkpoint``: the checkpoint broker.

The broker's evaluation loop and cost model come with the checkpoint work; until
then this entry point validates its configuration, serves its metrics endpoint and
says plainly that it has nothing to do, rather than pretending to checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="lattice-checkpoint",
        description="Run the Lattice checkpoint broker (not yet implemented: exits with a message).",
    )
    p.add_argument("--config", help="YAML config file (checkpoint section)")
    p.add_argument(
        "--quorum-endpoint",
        default=os.environ.get("LATTICE_QUORUM_ENDPOINT", "127.0.0.1:50051"),
        help="lattice-server gRPC address(es)",
    )
    p.parse_args(argv)
    print(
        "Error: the checkpoint broker is not implemented yet\n"
        "Hint: allocations run without checkpoint hints; preemption uses SIGTERM, grace, SIGKILL.",
        file=sys.stderr,
    )
    sys.exit(2)


if __name__ == "__main__":
    main()
