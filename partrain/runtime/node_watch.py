"""A node that stops answering: the other nodes notice it and stop, naming it, within train.timeout_s.

A node that dies closes its sockets and its peers' collectives fail at once. A node that hangs (its
processes stopped, SIGSTOP, a frozen machine) keeps its sockets open: the others would wait in a
collective for gloo's full timeout and then fail with a line that names no node. So in a multi-node
run (not an elastic one: torchrun's agent watches those) every rank runs a thread that, every
`BEAT_S`, reads each node's beat count from the run's TCP store, and the local rank 0 of each node
raises its node's count. A node whose count has not moved for `silent_after_s` (half of
train.timeout_s, at least `MIN_SILENT_S`) is silent; so is the store's host when the store itself
stops answering. The thread then hands one line to `on_silent` (the worker records it as its error
and ends its process at once: a rank waiting in a collective would heed torchrun's SIGTERM only at
its own timeout). The count measures that a node's processes run, not that they make progress: a
node busy saving or preparing data still beats. A node that ends (cleanly or not) marks itself as
left first, so the nodes finishing a little later do not take it for a hang. Clocks are never
compared between machines: each watcher times the counts it reads itself.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

log = logging.getLogger("partrain")

BEAT_S = 1.0
"""Seconds between two beats (and two looks at the other nodes)."""
MIN_SILENT_S = 3.0
"""A node is silent after at least this long without a beat (a loaded machine may pause a thread)."""


def silent_after(timeout_s: float) -> float:
    """Seconds without a beat after which a node counts as silent: half of train.timeout_s, so the
    others stop well within it (a collective alone would wait all of it)."""
    return max(MIN_SILENT_S, timeout_s / 2)


LEFT = "left"
"""A node's beat key holds its beat count, or this once the node ended."""


@dataclass
class Watcher:
    """What one rank knows of the nodes' beats (no threads, no clock of its own: `look` is given the
    time, so tests drive it). Per look: one `set` (local rank 0 only: its node's beat), one `check`
    and one `multi_get` of every node's key, so a large run's store sees a few calls per rank a second."""

    store: Any
    """A torch.distributed Store (TCPStore or a PrefixStore over it), shared by all nodes."""
    node: int
    nodes: int
    silent_after_s: float
    beats: bool = True
    """This rank beats for its node (its local rank 0); the others only look."""
    store_host_node: int = 0
    """The node whose process serves the store: when the store stops answering, that node is silent."""
    _count: int = 0
    _seen: Dict[int, tuple] = field(default_factory=dict)
    _left: set = field(default_factory=set)
    _store_ok_at: Optional[float] = None

    def beat(self) -> None:
        self._count += 1
        self.store.set(self._key(self.node), str(self._count))

    def leave(self) -> None:
        if self.beats:
            self.store.set(self._key(self.node), LEFT)

    def look(self, now: float) -> Optional[str]:
        """Beat, read the other nodes' beats; one line naming the silent nodes, or None."""
        if self._store_ok_at is None:
            self._store_ok_at = now
        others = [k for k in range(self.nodes) if k != self.node]
        try:
            if self.beats:
                self.beat()
            present = others
            if others and not self.store.check([self._key(k) for k in others]):  # some never beat yet
                present = [k for k in others if self.store.check([self._key(k)])]
            values = self.store.multi_get([self._key(k) for k in present]) if present else []
        except Exception:  # noqa: BLE001 - a store that times out or is gone: its host does not answer
            host_hangs = self.store_host_node != self.node and self.store_host_node not in self._left
            if now - self._store_ok_at > self.silent_after_s and host_hangs:
                return self._line([self.store_host_node], now - self._store_ok_at, "which serves the run's store ")
            return None
        self._store_ok_at = now
        counts = dict(zip(present, (bytes(v).decode() for v in values)))
        silent: List[int] = []
        for k in others:
            count = counts.get(k)
            if count == LEFT:  # ended (the run's end, or a failure its peers see at once)
                self._left.add(k)
                continue
            last_count, since = self._seen.get(k, (None, None))
            if since is None or count != last_count:
                self._seen[k] = (count, now)
            elif now - since > self.silent_after_s:
                silent.append(k)
        if not silent:
            return None
        return self._line(silent, max(now - self._seen[k][1] for k in silent))

    def _key(self, node: int) -> str:
        return f"beat-{node}"

    def _line(self, silent: List[int], quiet_s: float, what: str = "") -> str:
        names = ", ".join(f"node {k}" for k in silent)
        return (
            f"{names} {what}stopped answering: no sign of life for {quiet_s:.0f} s (train.timeout_s/2); "
            "its processes hang (stopped or frozen). The other nodes stop now; the last complete "
            "checkpoint is intact: stop every node, then start them all again with checkpoint.resume=auto"
        )


class NodeWatch:
    """The thread around a Watcher: `start()`, then `stop()` when the node ends (marks it as left)."""

    def __init__(self, watcher: Watcher, on_silent: Callable[[str], None], clock=time.monotonic) -> None:
        self.watcher = watcher
        self.on_silent = on_silent
        self.clock = clock
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partrain-node-watch", daemon=True)

    def start(self) -> "NodeWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2 * BEAT_S)
        try:
            self.watcher.leave()
        except Exception:  # noqa: BLE001 - the store's host may be gone already: nobody is left to tell
            pass

    def _run(self) -> None:
        while not self._done.wait(BEAT_S):
            line = self.watcher.look(self.clock())
            if line is not None and not self._done.is_set():
                self.on_silent(line)
                return


def store_client(host: str, port: int, prefix: str, timeout_s: float):
    """A store connection of its own for the watch (its blocking calls never wait on the training's),
    with keys under prefix; its calls give up after timeout_s."""
    import torch.distributed as dist

    base = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, base)


@contextlib.contextmanager
def watching_nodes(run, env, on_silent: Callable[[str], None]) -> Iterator[None]:
    """Watch the other nodes for the block (see the module docstring); nothing for one node or an
    elastic run. run: a RunConfig; env: DistEnv, after the process group exists (the store at
    env.master_addr:master_port is up)."""
    from partrain.blueprint.validate_elastic import is_elastic

    if run.cluster.nodes <= 1 or is_elastic(run.cluster):
        yield
        return
    silent_s = silent_after(run.train.timeout_s)
    per_node = max(1, env.local_world_size)
    try:
        # Each call gives up after half the silence: a frozen store host is named within train.timeout_s.
        prefix = f"partrain/node-watch/attempt-{env.restart_count}/"
        store = store_client(env.master_addr, env.master_port, prefix, silent_s / 2)
    except Exception as exc:  # noqa: BLE001 - the watch is an aid: training goes on without it
        log.warning("not watching the other nodes (store %s:%s: %s)", env.master_addr, env.master_port, exc)
        yield
        return
    # Every rank looks (each ends itself at once: a rank waiting in a collective would not heed
    # torchrun's SIGTERM until its own timeout), local rank 0 alone beats for the node.
    watcher = Watcher(store, env.rank // per_node, max(1, env.world_size // per_node), silent_s, env.local_rank == 0)
    watch = NodeWatch(watcher, on_silent).start()
    try:
        yield
    finally:
        watch.stop()
