"""Stopping a run cleanly: the workers' stop request and the launcher's signal forwarding.

Worker side (`StopWatch`): SIGINT, SIGTERM and SIGHUP are blocked in every thread and received by
one daemon thread (sigtimedwait), so they are seen even while the main thread sits in a long
collective or kernel. The first sets `signum` (the train loop agrees on it with its peers, finishes
the step, saves and exits); a second ends the process at once (exit 128 + signal; a checkpoint
being written stays `.partial`). The same thread is the orphan check: the kernel sends SIGHUP when
the launching process dies (prctl PR_SET_PDEATHSIG), and the thread also polls os.getppid() in
case that signal was not set or raced with the parent's death. Once a stop was requested the
process ends by itself after `hard_exit_after_s` (train.timeout_s) whatever the main thread does.

Launcher side (`Forwarder`): `partrain train` starts torchrun in a session of its own (a terminal's
Ctrl-C reaches the launcher only) with SIGTERM as its parent-death signal. The first SIGINT/SIGTERM
is passed straight to the workers (torchrun's children) once they run their StopWatch (seen in
/proc: they block the signal): they stop by themselves after the current step and torchrun ends
because they ended (torchrun itself would kill them 30 s after forwarding). Before that (workers
still starting) it goes to torchrun, which shuts them down without restarting them. A second one
goes to torchrun (which shuts the workers down without restarting them) and to the workers (which
then exit at once). No torch import.

The kernel sends the parent-death signal again each time another thread of the dying parent exits
(the child is handed to a sibling thread first): a worker ignores repeated SIGHUPs, and the
launcher keeps a single thread while torchrun runs (its progress display refreshes on events),
so that torchrun sees one SIGTERM, not a second one that would make it cut its workers short.

Exit codes: 128 + signal number, the shell's convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP
(the launcher died).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

from partrain.runtime.procs import blocks_signal, children_of, set_parent_death_signal, workers_of_run

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a worker treats as a request to stop."""
PARENT_DEATH_SIGNAL = signal.SIGHUP
"""What a worker receives when its launcher (torchrun, srun's step daemon) dies."""
FORWARDED = (signal.SIGINT, signal.SIGTERM)
"""What `partrain train` forwards to its workers."""


def exit_code(signum: int) -> int:
    """The process exit code of a run stopped by `signum` (128 + signal number)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(text: str) -> None:
    """One line to stderr without Python's buffered streams (their locks may be held elsewhere)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class StopWatch:
    """A worker's stop request: set by the first stop signal or by the parent's death."""

    def __init__(self, label: str = "worker", hard_exit_after_s: float = 120.0, poll_s: float = 0.5) -> None:
        self.label = label
        self.hard_exit_after_s = hard_exit_after_s
        """Once a stop was requested, exit after this long whatever the main thread is doing."""
        self.poll_s = poll_s
        self.signum = 0
        """The signal of the first stop request (PARENT_DEATH_SIGNAL when the parent died); 0 = none."""
        self.reason = ""
        self.exit_at_once = False
        """End the process at once on a stop request (an elastic run before its first step: nothing to
        save, and torchrun restarting the workers for a node that joined must not wait for a clean stop)."""
        self._since: Optional[float] = None
        self._parent = 0

    def start(self) -> "StopWatch":
        """Call from the main thread before any other thread exists (threads inherit the blocked set)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        set_parent_death_signal(PARENT_DEATH_SIGNAL)
        self._parent = os.getppid()
        if self._parent == 1:  # the parent died before the death signal was set
            self._request(PARENT_DEATH_SIGNAL, "its launcher died before it started")
        threading.Thread(target=self._watch, name="partrain-stop", daemon=True).start()
        return self

    def _request(self, signum: int, reason: str) -> None:
        if self.exit_at_once:
            self._exit_now(signum, f"{reason} before training started")
        self.reason = reason
        self._since = time.monotonic()
        self.signum = int(signum)

    def _watch(self) -> None:
        while True:
            info = signal.sigtimedwait(STOP_SIGNALS, self.poll_s)
            if info is not None:
                if self.signum and info.si_signo == PARENT_DEATH_SIGNAL:
                    pass  # the kernel repeats it as each thread of a dying parent exits: not a second request
                elif self.signum:
                    self._exit_now(info.si_signo, f"a second stop signal ({signal_name(info.si_signo)})")
                elif info.si_signo == PARENT_DEATH_SIGNAL:
                    self._request(info.si_signo, "its launcher died (SIGHUP)")
                else:
                    self._request(info.si_signo, signal_name(info.si_signo))
            elif not self.signum and os.getppid() != self._parent:
                self._request(PARENT_DEATH_SIGNAL, f"its launcher (pid {self._parent}) died")
            if self._since is not None and time.monotonic() - self._since > self.hard_exit_after_s:
                self._exit_now(self.signum, f"no clean stop within {self.hard_exit_after_s:g} s of {self.reason}")

    def _exit_now(self, signum: int, why: str) -> None:
        _say(f"{self.label}: stopped at once by {why}; nothing saved")
        os._exit(exit_code(signum))


class Interrupted(Exception):
    """A stop signal reached the launcher before torchrun was started."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}")


class Forwarder:
    """The launcher's SIGINT/SIGTERM handlers while it prepares and follows a run (restored after)."""

    def __init__(self) -> None:
        self.received: List[int] = []
        """Stop signals received, in order."""
        self.torchrun: Optional[int] = None
        self.run_dir: Optional[Path] = None
        self._old: dict = {}

    def __enter__(self) -> "Forwarder":
        for sig in FORWARDED:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        if self.torchrun is None:
            raise Interrupted(signum)
        workers = children_of(self.torchrun)
        if not workers and self.run_dir is not None:  # torchrun is gone: its orphaned workers, if any
            workers = [pid for pid in workers_of_run(self.run_dir) if pid != self.torchrun]
        ready = bool(workers) and all(blocks_signal(pid, signum) for pid in workers)
        if len(self.received) > 1 or not ready:
            # torchrun's agent forwards it to the workers and shuts down without restarting them
            # (a worker still starting, its StopWatch not yet running, would just die of it and be restarted).
            _kill(self.torchrun, signum)
        if ready or len(self.received) > 1:
            for pid in workers:
                _kill(pid, signum)

    def popen_options(self) -> dict:
        """Popen keyword arguments for torchrun: its own session, dies with this process."""
        return {"start_new_session": True, "preexec_fn": _child_setup(os.getpid())}

    def started(self, pid: int, run_dir: Path) -> None:
        """torchrun runs as `pid`, its workers in run_dir."""
        self.torchrun = pid
        self.run_dir = Path(run_dir)

    def blocked(self):
        """Context: hold SIGINT/SIGTERM while torchrun is being started (delivered when it is known)."""
        return _Blocked()


class _Blocked:
    def __enter__(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _child_setup(parent: int) -> Callable[[], None]:
    def setup() -> None:  # runs in torchrun's process between fork and exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before the death signal was set
            os._exit(1)

    return setup
