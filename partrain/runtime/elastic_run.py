"""torchrun (`torch.distributed.run`) with a bounded exit barrier, for multi-node runs.

    python -m partrain.runtime.elastic_run --exit-barrier-timeout=S TORCHRUN_ARGS...

When its workers have ended, torchrun's elastic agent waits in an exit barrier for the agents of the
other nodes, 300 s by default, and torchrun has no option for it. A node whose peer died after a
clean stop (partrain's workers agree on the stop step, so the dead node's ranks stop with everyone)
would then linger for five minutes. Here the agent waits at most S seconds (train.timeout_s), so
"a node that dies -> the others stop within train.timeout_s" holds. Everything else is torchrun's.
"""

from __future__ import annotations

import sys
from typing import List, Optional

FLAG = "--exit-barrier-timeout="


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    timeout = 300.0
    if args and args[0].startswith(FLAG):
        timeout = float(args.pop(0)[len(FLAG) :])
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.run import main as torchrun_main

    original_init = LocalElasticAgent.__init__

    def init_with_timeout(self, *a, **kw) -> None:
        # torch's launcher builds the agent without this argument; the default is what changes.
        kw.setdefault("exit_barrier_timeout", timeout)
        original_init(self, *a, **kw)

    # A torch whose agent no longer takes the argument runs as plain torchrun (its own barrier).
    if "exit_barrier_timeout" in inspect.signature(original_init).parameters:
        LocalElasticAgent.__init__ = init_with_timeout
    torchrun_main(args)


if __name__ == "__main__":
    main()
