"""Where the ranks of a task launch go (pure): ranks per node, in node order.

Node i of the launch gets the consecutive ranks after those of the nodes before
it, so with ``tasks_per_node`` K node i holds ranks [i*K, (i+1)*K) (spec: MPI
Process Management, launch flow). Forms, as with ``srun``:

* neither given: one rank per node;
* ``tasks_per_node`` K only: K on every node;
* ``num_tasks`` N and K: ceil(N/K) nodes, K each, the last one the rest;
* ``num_tasks`` N only: N spread evenly, the first nodes taking one more.
"""

from __future__ import annotations

from collections.abc import Sequence

from lattice_common.errors import ValidationError

__all__ = ["MAX_TASKS_PER_NODE", "rank_layout"]

#: more processes than this on one node is a typo, not a layout
MAX_TASKS_PER_NODE = 4096


def rank_layout(nodes: Sequence[str], num_tasks: int = 0, tasks_per_node: int = 0) -> list[int]:
    """Ranks on each of ``nodes`` (trailing nodes with none are left out of the list)."""
    if not nodes:
        raise ValidationError("a launch needs at least one node")
    if num_tasks < 0 or tasks_per_node < 0:
        raise ValidationError(
            "the number of tasks and tasks per node must not be negative",
            hint="Give -n N (total ranks) and/or --tasks-per-node K with positive numbers.",
        )
    if tasks_per_node > MAX_TASKS_PER_NODE:
        raise ValidationError(
            f"--tasks-per-node {tasks_per_node} is more than {MAX_TASKS_PER_NODE}",
            hint="One rank per core (or per GPU) is the usual layout.",
        )
    n = len(nodes)
    if num_tasks == 0:
        return [tasks_per_node or 1] * n
    if tasks_per_node:
        needed = -(-num_tasks // tasks_per_node)
        if needed > n:
            raise ValidationError(
                f"{num_tasks} tasks at {tasks_per_node} per node need {needed} nodes; "
                f"the launch has {n}",
                hint="Lower -n, raise --tasks-per-node, or submit a bigger allocation.",
            )
        layout = [tasks_per_node] * needed
        layout[-1] = num_tasks - tasks_per_node * (needed - 1)
        return layout
    base, extra = divmod(num_tasks, n)
    if base + (1 if extra else 0) > MAX_TASKS_PER_NODE:
        raise ValidationError(
            f"{num_tasks} tasks on {n} nodes is more than {MAX_TASKS_PER_NODE} per node",
            hint="Lower -n or submit a bigger allocation.",
        )
    layout = [base + (1 if i < extra else 0) for i in range(n)]
    return [k for k in layout if k > 0]
