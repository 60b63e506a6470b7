"""Who a node sends its PMI fence keys to: a star, or a two-level tree above the fanout.

Pure: node ids in rank order in, a :class:`FenceTopology` out.  Up to
``fanout`` nodes the head (the node of rank 0) collects from everybody.  Above
it the nodes are cut into consecutive groups of about sqrt(N) (never more than
``fanout`` groups); each group's first node is its *leader*, collects its
group's keys and sends them, merged, to the head in one call, so the head
answers ~sqrt(N) callers instead of N (spec: "a tree-based reduction can be
used instead of a star to reduce head-node pressure").  The head leads group 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FenceTopology", "fence_topology"]


@dataclass(frozen=True)
class FenceTopology:
    """The fence routes of one launch."""

    head: str
    #: node -> the node it sends its fence to; the head maps to None
    parent: dict[str, str | None]
    #: leader -> the nodes it collects from (itself included)
    groups: dict[str, tuple[str, ...]]
    #: the leaders the head collects from (itself included); empty for a star
    leaders: tuple[str, ...]

    @property
    def is_tree(self) -> bool:
        return bool(self.leaders)


def fence_topology(nodes: Sequence[str], fanout: int = 128) -> FenceTopology:
    """The star (``len(nodes) <= fanout``) or two-level tree for ``nodes`` (rank order)."""
    if not nodes:
        raise ValueError("a launch needs at least one node")
    if len(set(nodes)) != len(nodes):
        raise ValueError("a launch names each node once")
    if fanout < 2:
        raise ValueError(f"fanout must be at least 2, got {fanout}")
    head = nodes[0]
    n = len(nodes)
    if n <= fanout:
        parent: dict[str, str | None] = {node: head for node in nodes}
        parent[head] = None
        return FenceTopology(head=head, parent=parent, groups={head: tuple(nodes)}, leaders=())
    size = max(math.isqrt(n - 1) + 1, -(-n // fanout))
    groups: dict[str, tuple[str, ...]] = {}
    parent = {}
    for start in range(0, n, size):
        members = tuple(nodes[start : start + size])
        leader = members[0]
        groups[leader] = members
        for m in members:
            parent[m] = leader
        parent[leader] = head
    parent[head] = None
    return FenceTopology(head=head, parent=parent, groups=groups, leaders=tuple(groups))
