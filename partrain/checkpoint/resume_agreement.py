"""Before resuming, every rank must have found the same checkpoints.

A checkpoint folder that is not one folder for all nodes (node-local disks, a mount missing on one
node) shows each node its own checkpoints: node 0 would load step N while node 1 finds none and
starts training, and the first collective hangs until train.timeout_s. So resume=auto gathers what
each rank found (one small all-gather, before any file is read) and, when the findings differ,
every rank raises the same `Disagreement` naming the nodes: the workers end with exit 2 at once.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import List, Sequence, Tuple

from partrain.checkpoint.dist_util import all_gather, rank_world
from partrain.runtime.agreement import Disagreement
from partrain.runtime.shared_checkpoints import SHARED_DIR_FIX

Finding = Tuple[Tuple[str, ...], Tuple[str, ...]]
"""What one rank found in the checkpoint folder: (complete checkpoints, incomplete step folders), names."""


def check_same_checkpoints(root: Path, found: Finding, ranks_per_node: int) -> None:
    """Collective: raise Disagreement on every rank when any rank found other checkpoints than the rest."""
    rank, _ = rank_world()
    gathered = all_gather((found, socket.gethostname()))
    lines = differing_findings(root, [f for f, _ in gathered], [host for _, host in gathered], ranks_per_node)
    if lines:
        raise Disagreement(lines, fix=SHARED_DIR_FIX + "; then start every node again")


def differing_findings(root: Path, findings: Sequence[Finding], hosts: Sequence[str], ranks_per_node: int) -> List[str]:
    """One line naming each node's newest checkpoint when the ranks' findings differ; [] when all agree.
    findings/hosts: per global rank; ranks_per_node: consecutive ranks per node (its node is rank // it)."""
    if len(set(findings)) <= 1:
        return []
    per_node = max(1, ranks_per_node)
    groups: List[Tuple[Finding, List[int]]] = []
    for rank, finding in enumerate(findings):
        if groups and groups[-1][0] == finding and groups[-1][1][-1] == rank - 1:
            groups[-1][1].append(rank)
        else:
            groups.append((finding, [rank]))
    parts = []
    for (complete, incomplete), ranks in groups:
        nodes = sorted({r // per_node for r in ranks})
        where = (
            f"node{'s' if len(nodes) > 1 else ''} {_span(nodes)} (rank{'s' if len(ranks) > 1 else ''} {_span(ranks)}, "
            f"host {hosts[ranks[0]]})"
        )
        newest = f"newest {complete[-1]} of {len(complete)} complete" if complete else "no complete checkpoint"
        more = f", {len(incomplete)} incomplete" if incomplete else ""
        parts.append(f"{newest}{more} on {where}")
    return [f"the checkpoints in {root} (checkpoint.dir): " + "; ".join(parts)]


def _span(numbers: List[int]) -> str:
    return str(numbers[0]) if numbers[0] == numbers[-1] else f"{numbers[0]}-{numbers[-1]}"
