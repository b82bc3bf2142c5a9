"""N exporting processes, one per shard, in two phases: all verify, then (only if all agree) all write.

Each process (`python -m partrain.checkpoint.hf_procs`: a fresh interpreter that inherits nothing
and never re-runs the caller's main script, as multiprocessing's spawn would) gets its ShardJob on
stdin, first checks the SHA-256 of its share of the checkpoint's files and reports the problems
it found; the parent waits for every report, then tells all processes to write their shard, or to
stop when any file is damaged, so a damaged checkpoint never leaves an exported folder. Messages
are JSON lines on the child's stdout (its prints and logs go to stderr); a failing process sends
its traceback as text.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from partrain.checkpoint.hf_plan import ShardJob


class ExportProcessFailed(RuntimeError):
    """An exporting process raised or died; carries its traceback or exit code."""


def _receive(proc: subprocess.Popen) -> Tuple[str, Any]:
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise ExportProcessFailed(f"exporting process {proc.pid} ended (exit code {code}) without reporting")
    kind, value = json.loads(line)
    if kind == "error":
        raise ExportProcessFailed(value)
    return kind, value


def _tell(proc: subprocess.Popen, word: str) -> None:
    try:
        proc.stdin.write((word + "\n").encode())
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # it has died: _receive reports that


def run_shard_processes(jobs: Sequence[ShardJob], before_write) -> List[Dict[str, Any]]:
    """Run one process per job. `before_write(problems)` is called once every process verified its
    files, with [(path, rule)] of all of them; it raises to stop (the processes then write nothing)
    or prepares the output folder. Returns each process's write_shard report, in job order."""
    started: List[subprocess.Popen] = []
    try:
        for job in jobs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "partrain.checkpoint.hf_procs"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            started.append(proc)
            data = pickle.dumps(job)
            proc.stdin.write(len(data).to_bytes(8, "little") + data)
            proc.stdin.flush()
        problems = [(Path(p), rule) for proc in started for p, rule in _receive(proc)[1]]
        try:
            before_write(problems)
        except BaseException:
            for proc in started:
                _tell(proc, "stop")
            raise
        for proc in started:
            _tell(proc, "write")
        return [_receive(proc)[1] for proc in started]
    finally:
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()


def _child() -> None:
    """The exporting process: job from stdin, JSON lines to the real stdout, everything else to stderr."""
    out = sys.stdout
    sys.stdout = sys.stderr

    def send(kind: str, value: Any) -> None:
        out.write(json.dumps([kind, value]) + "\n")
        out.flush()

    try:
        size = int.from_bytes(sys.stdin.buffer.read(8), "little")
        job: ShardJob = pickle.loads(sys.stdin.buffer.read(size))  # from our own parent, over a pipe
        from partrain.checkpoint.hf_shards import write_shard_in_child
        from partrain.checkpoint.record import file_problems, read_record

        checkpoint = Path(job.checkpoint)
        problems = file_problems(checkpoint, read_record(checkpoint, key="PATH"), job.verify_files)
        send("verified", [(str(path), rule) for path, rule in problems])
        if sys.stdin.readline().strip() != "write":
            return
        job.verify_files = []  # checked above, before any process wrote
        send("done", write_shard_in_child(job))
    except BaseException:  # noqa: BLE001 - whatever happened, the parent must hear it
        send("error", traceback.format_exc())


if __name__ == "__main__":
    _child()
