"""Slurm anchor: Debian's slurm-wlm on this machine, tuned, measured side by side.

Installs slurm-wlm + munge with apt when missing (root), starts a private munged,
slurmctld and 2, then 8 slurmd "nodes" (``slurmd -N``, one port each) on loopback in a
temp dir, measures and stops them (the tuned config and the method: ``_slurm.py``):

* ``par_submits_per_s``: ``--clients`` concurrent ``sbatch --hold --wrap true`` loops for
  ``--seconds`` (held, so the jobs stay Pending like the Lattice submit benchmark's).
* ``jobs_per_s``: ``--jobs`` trivial one-node jobs (``sbatch --wrap true``), first submit
  until none is pending, running or completing; per node count (``--nodes 2,8``).

    uv run python scripts/bench/slurm_anchor.py [--quick] [--nodes 2,8] [--jobs N]

The other benchmarks call ``_slurm.anchor()`` themselves to report a ratio from the same
run; this script is the anchor alone. The last line is JSON; ``available`` is false (with
``reason``) where Slurm cannot be installed or run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, parser
from _slurm import anchor


def main() -> None:
    p = parser(__doc__.split("\n\n")[0], default_runs=1)
    p.add_argument("--nodes", default="2,8", help="slurmd counts for the end-to-end test")
    p.add_argument("--jobs", type=int, default=None, help="trivial jobs per node count (500)")
    p.add_argument("--clients", type=int, default=32, help="concurrent sbatch loops (submit rate)")
    p.add_argument("--seconds", type=float, default=None, help="submit-rate window (10)")
    args = p.parse_args()
    nodes = tuple(int(x) for x in args.nodes.split(",") if x.strip())
    res = anchor(
        node_counts=nodes,
        jobs=args.jobs or (40 if args.quick else 500),
        submit_clients=args.clients,
        submit_seconds=args.seconds or (2.0 if args.quick else 10.0),
        keep=args.keep,
    )
    if not res["available"]:
        log(f"Slurm anchor unavailable: {res['reason']}")
    emit(res)


if __name__ == "__main__":
    main()
