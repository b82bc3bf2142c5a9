"""Issue 38 item 5: a node that stops answering is named by the others within train.timeout_s.

The watchers of two or three nodes share one in-process store and are driven with made-up times
(no threads, no sleeping): a node whose beat stops is named once silent_after_s has passed, a node
that ended is never named, a store that stops answering names the node serving it. One test runs
the real thread on a TCPStore. Measured by hand on loopback (two launchers, train.timeout_s=15,
SIGSTOP of node 1's launcher, torchrun and workers): node 0 ended 8.8 s later with `training
failed: rank 1: node 1 stopped answering: ...`, its checkpoints intact (before: 16.6 s and
`RuntimeError: Application timeout caused pair closure`); with train.timeout_s=10 after 6.2 s, and
both nodes started again with checkpoint.resume=auto resumed at step 10 and matched an uninterrupted
run's 60 losses within 1.8e-7."""

from __future__ import annotations

import threading

import torch.distributed as dist

from partrain.runtime.node_watch import MIN_SILENT_S, NodeWatch, Watcher, silent_after


def _watchers(store, nodes: int = 2, silent: float = 5.0):
    return [Watcher(store, k, nodes, silent) for k in range(nodes)]


def test_silence_is_half_the_timeout_and_never_below_the_minimum():
    assert silent_after(60) == 30 and silent_after(4) == MIN_SILENT_S


def test_a_node_whose_beat_stops_is_named_after_the_silence():
    store = dist.HashStore()
    zero, one = _watchers(store)
    for t in range(0, 4):  # both beat
        assert zero.look(float(t)) is None and one.look(float(t)) is None
    # Node 1 hangs: only node 0 still looks (and beats). It read node 1's last beat at t=4.
    for t in range(4, 10):
        assert zero.look(float(t)) is None, t
    line = zero.look(10.0)
    assert line is not None and line.startswith("node 1 stopped answering: no sign of life for 6 s")
    assert "checkpoint.resume=auto" in line and "\n" not in line


def test_a_node_that_ended_is_not_a_hang_and_the_others_are_watched_apart():
    store = dist.HashStore()
    zero, one, two = _watchers(store, nodes=3)
    for t in range(3):
        assert all(w.look(float(t)) is None for w in (zero, one, two))
    one.leave()  # node 1 ended (the run's end, or a failure its peers see at once)
    for t in range(3, 20):
        assert zero.look(float(t)) is None and two.look(float(t)) is None


def test_a_node_that_never_beats_is_named_too():
    store = dist.HashStore()
    zero, _ = _watchers(store)
    assert all(zero.look(float(t)) is None for t in range(6))
    assert zero.look(6.0).startswith("node 1 stopped answering")


class _FrozenStore:
    """A store whose host stopped: every call fails (TCPStore's calls time out)."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("timed out")

        return fail


def test_a_store_that_stops_answering_names_the_node_serving_it():
    one = Watcher(_FrozenStore(), 1, 2, 5.0)
    assert all(one.look(float(t)) is None for t in range(6))
    line = one.look(6.0)
    assert line.startswith("node 0 which serves the run's store stopped answering"), line
    # The store's host itself does not blame itself.
    assert all(Watcher(_FrozenStore(), 0, 2, 5.0).look(float(t)) is None for t in range(10))


def test_the_thread_hands_over_one_line_on_a_real_tcp_store(monkeypatch):
    from partrain.runtime import node_watch

    monkeypatch.setattr(node_watch, "BEAT_S", 0.05)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore("t/", server)
    store.set("beat-1", "7")  # node 1 beat once, then hung
    told = []
    done = threading.Event()
    watch = NodeWatch(Watcher(store, 0, 2, 0.3), lambda line: (told.append(line), done.set())).start()
    assert done.wait(timeout=5), "no line"
    watch.stop()
    assert len(told) == 1 and told[0].startswith("node 1 stopped answering")
    assert store.get("beat-0") == b"left"
