"""Before a multi-node run trains, every node checks that all nodes composed the same run.

Each node composes its config itself (its own command line, its own conf/ and data cache), so two
nodes can silently differ (an optimizer setting, a recipe edited on one machine). Every rank hashes
its resolved config (as flat `key -> value` pairs, minus the node-local keys below) and the facts of
its token data (counts, tokenizer, dtype: not the cache paths), and the hashes are all-gathered.
Only when they differ are the flat maps themselves gathered, so that every rank can name the keys:
one `Disagreement` line per key, e.g. `optim.lr: 0.001 on node 0, 0.002 on node 1`.

Node-local keys (may differ between nodes): cluster.node_rank, train.run_dir (each node's own run
folder) and data.cache_dir (a node-local token cache; the tokens themselves are compared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Dict, List, Mapping

NODE_LOCAL_KEYS = frozenset({"cluster.node_rank", "train.run_dir", "data.cache_dir"})
"""Config keys each node sets for itself; left out of the agreement."""

DATA_KEY = "data (packed tokens)"
"""The pseudo key under which the token data's facts are compared."""

DATA_FACTS = (
    "format",
    "dtype",
    "vocab_size",
    "eos_id",
    "n_train_tokens",
    "n_eval_tokens",
    "n_documents",
    "tokenizer",
    "stream_source",
)


SAME_RUN_FIX = "start every node with the same overrides, recipes and data (node-local keys aside)"


class Disagreement(Exception):
    """The nodes composed different runs (or found different checkpoints); `lines` names each
    differing key and its values per node, `fix` what to do (the workers end with exit 2)."""

    def __init__(self, lines: List[str], fix: str = SAME_RUN_FIX) -> None:
        self.lines = lines
        self.fix = fix
        super().__init__("the nodes do not agree on the run: " + "; ".join(lines))


def flat_items(config, prefix: str = "") -> Dict[str, str]:
    """A config dataclass (or dict) as {"group.key": repr-ish text}, node-local keys left out."""
    tree = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    flat: Dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_items(value, name + "."))
        elif name not in NODE_LOCAL_KEYS:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def data_facts(meta: Mapping) -> str:
    """What must match about the packed token data (not where it lies)."""
    return json.dumps({k: meta.get(k) for k in DATA_FACTS}, sort_keys=True)


def digest(flat: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(flat.items())).encode()).hexdigest()


def differences(maps: List[dict]) -> List[str]:
    """One line per key whose value is not the same on every node: `key: VALUE on node K, ...`.

    maps: one {"node": K, "flat": {...}} per rank (several ranks of one node say the same)."""
    by_node = {m["node"]: m["flat"] for m in maps}
    keys = sorted(set().union(*(flat.keys() for flat in by_node.values())))
    lines = []
    for key in keys:
        values = {node: flat.get(key, "(missing)") for node, flat in sorted(by_node.items())}
        if len(set(values.values())) > 1:
            lines.append(f"{key}: " + ", ".join(f"{value} on node {node}" for node, value in values.items()))
    return lines


def check_nodes_agree(config, meta: Mapping, node_rank: int, world_size: int) -> None:
    """Collective over the default process group; raises Disagreement on every rank if the nodes differ."""
    import torch.distributed as dist

    flat = flat_items(config)
    flat[DATA_KEY] = data_facts(meta)
    hashes: list = [None] * world_size
    dist.all_gather_object(hashes, digest(flat))
    if len(set(hashes)) == 1:
        return
    maps: list = [None] * world_size
    dist.all_gather_object(maps, {"node": node_rank, "flat": flat})
    lines = differences(maps)
    # Two ranks of one node can differ only if their node composed differently per rank; still refuse.
    raise Disagreement(lines or ["the resolved configs differ between ranks of one node"])
