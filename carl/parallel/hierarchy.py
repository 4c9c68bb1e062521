"""Hierarchical sync: exact fp32 all-reduce inside a node, compression only on the links between nodes.

torchrun numbers ranks node by node (global rank = node index x ranks per node + local rank), so node ``k`` holds
ranks ``[k L, (k + 1) L)``. A bucket is first averaged exactly inside the node (the fast NVLink/PCIe domain); then
only each node's *leader* (local rank 0) runs the compressed reduction with the other leaders and broadcasts the
result inside its node. One compressed message per node crosses the slow network, not one per GPU, and every
replica applies the same gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from carl.parallel.context import DistContext


@dataclass
class NodeGroups:
    """This rank's view of the node layout."""

    intra: dist.ProcessGroup | None  # this node's ranks (None for one-rank nodes)
    leaders: dist.ProcessGroup | None  # the nodes' local-rank-0 ranks; None unless this rank leads and nodes > 1
    leader: int  # global rank of this node's leader
    nodes: int


def node_groups(ctx: DistContext, node_size: int) -> NodeGroups:
    """Build the groups (``new_group`` is collective over the default group: every rank calls this, in order)."""
    world = ctx.world_size
    if node_size < 1 or world % node_size:
        raise ValueError(
            f"parallel.node_size={node_size} must divide the world size {world} (ranks per node x nodes); "
            "leave parallel.node_size=0 to take torchrun's LOCAL_WORLD_SIZE"
        )
    nodes = world // node_size
    leader = ctx.rank - ctx.rank % node_size
    intra = None
    for node in range(nodes):
        ranks = list(range(node * node_size, (node + 1) * node_size))
        group = dist.new_group(ranks)
        if ctx.rank in ranks and node_size > 1:
            intra = group
    leaders_ranks = [node * node_size for node in range(nodes)]
    group = dist.new_group(leaders_ranks)
    leaders = group if ctx.rank == leader and nodes > 1 else None
    return NodeGroups(intra, leaders, leader, nodes)
