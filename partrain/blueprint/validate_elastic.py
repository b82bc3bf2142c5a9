"""Rules for an elastic multi-node run (cluster.min_nodes < cluster.nodes).

An elastic run re-plans its layout whenever the number of processes changes, and resumes from the
newest checkpoint: so it must save checkpoints, into one folder every node sees, and its layout must
be the planner's to choose. The rule chosen here is the plain one: `parallel=auto` (a layout given
degree by degree fits one world size only; fixed degrees on the command line stay fixed where they
can). `elastic_problems` appends to the collector `validate` passes in.
"""

from __future__ import annotations


def is_elastic(cluster) -> bool:
    """Whether the run keeps going on fewer nodes (cluster.min_nodes set below cluster.nodes)."""
    return cluster.min_nodes is not None and cluster.min_nodes < cluster.nodes


def elastic_problems(c, run) -> None:
    cl = run.cluster
    if cl.min_nodes is None:
        return
    c.check(
        1 <= cl.min_nodes <= cl.nodes,
        "cluster.min_nodes",
        cl.min_nodes,
        f"must be between 1 and cluster.nodes ({cl.nodes})",
        f"e.g. cluster.min_nodes={max(1, cl.nodes - 1)} (train on while that many nodes remain), or leave it unset",
    )
    c.check(
        cl.elastic_wait_s >= 1,
        "cluster.elastic_wait_s",
        cl.elastic_wait_s,
        "must be at least 1 second",
        "e.g. cluster.elastic_wait_s=30",
    )
    if not is_elastic(cl) or cl.min_nodes < 1:
        return
    why = f"an elastic run (cluster.min_nodes={cl.min_nodes} < cluster.nodes={cl.nodes})"
    c.check(
        run.parallel.auto,
        "parallel.auto",
        run.parallel.auto,
        f"{why} re-plans its layout for the processes that remain; only the planner can do that",
        "add parallel=auto (degrees given on the command line stay fixed where they can), or unset cluster.min_nodes",
    )
    c.check(
        run.checkpoint.every_steps > 0,
        "checkpoint.every_steps",
        run.checkpoint.every_steps,
        f"{why} resumes from the newest checkpoint after a node is lost or joins",
        "set checkpoint.every_steps to a few steps (steps since the last save are trained again)",
    )
    c.check(
        bool(run.checkpoint.dir),
        "checkpoint.dir",
        run.checkpoint.dir,
        f"{why} needs its checkpoints in one folder every node sees",
        "set checkpoint.dir to a folder on a file system shared by all nodes",
    )
