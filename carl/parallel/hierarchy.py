"""Hierarchical sync: exact fp32 all-reduce inside a node, compression only on the links between nodes.

torchrun numbers ranks node by node (global rank = node index x ranks per node + local rank), so node ``k`` holds
ranks ``[k L, (k + 1) L)``. Every rank belongs to two groups: its node (the fast NVLink/PCIe domain) and its
"column", the ranks with the same local rank on every node. A bucket is first averaged exactly inside the node;
then every column runs the compressed reduction on the node means. All ranks of a node enter it with the same
node mean and the same (name-keyed) compressor state, so every column computes the same result and every replica
applies the same gradient.
"""
from __future__ import annotations

import torch.distributed as dist

from carl.parallel.context import DistContext


def node_groups(ctx: DistContext, node_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(intra_node, inter_node)`` groups of this rank; ``None`` where the group would only hold this rank.

    Every rank must call this (``new_group`` is collective over the default group) in the same order.
    """
    world = ctx.world_size
    if node_size < 1 or world % node_size:
        raise ValueError(
            f"parallel.node_size={node_size} must divide the world size {world} (ranks per node x nodes); "
            "leave parallel.node_size=0 to take torchrun's LOCAL_WORLD_SIZE"
        )
    nodes = world // node_size
    intra = inter = None
    for node in range(nodes):
        ranks = list(range(node * node_size, (node + 1) * node_size))
        group = dist.new_group(ranks)
        if ctx.rank in ranks and node_size > 1:
            intra = group
    for local in range(node_size):
        ranks = [node * node_size + local for node in range(nodes)]
        group = dist.new_group(ranks)
        if ctx.rank in ranks and nodes > 1:
            inter = group
    return intra, inter
