"""A bare Raft member (QuorumMember, no API) in its own process, for raft_commit.py's
in-process-leader variant. Prints "ready" once started; runs until SIGTERM/SIGINT.

    python _raft_member.py --id 2 --bind 127.0.0.1:P --peers '{"1": "...", "3": "..."}'
        --data-dir DIR [--min-timeout 5 --max-timeout 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--peers", required=True, help="JSON object id -> raft address")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--bootstrap", action="store_true")
    # Followers get long election timeouts so that the benchmark's in-process member is
    # the one that becomes leader; they only matter for elections, not for commits.
    p.add_argument("--min-timeout", type=float, default=0.15)
    p.add_argument("--max-timeout", type=float, default=0.35)
    p.add_argument("--append-entries-period", type=float, default=0.01)
    a = p.parse_args()

    from lattice_quorum.member import QuorumMember

    member = QuorumMember(
        node_id=a.id,
        bind=a.bind,
        peers={int(k): v for k, v in json.loads(a.peers).items()},
        data_dir=a.data_dir,
        bootstrap=a.bootstrap,
        raft_min_timeout=a.min_timeout,
        raft_max_timeout=a.max_timeout,
        append_entries_period=a.append_entries_period,
    )
    loop = asyncio.get_running_loop()
    member.attach_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        member.close()


if __name__ == "__main__":
    asyncio.run(main())
