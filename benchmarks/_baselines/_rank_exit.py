"""The end of a baseline worker under torchrun: run, write the result, leave without hanging.

The worker writes its result (rank 0), then `partrain.runtime.lifecycle` meets the peers at a
barrier, destroys the group and leaves with os._exit (gloo aborts at interpreter exit otherwise);
a failing rank prints its error and exits 1 so torchrun stops the rest.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable

from partrain.runtime.lifecycle import finish_group, leave


def run_rank_and_exit(work: Callable[[], dict], out_path: str) -> None:
    import torch.distributed as dist

    try:
        result = work()
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        finish_group()
    except BaseException as exc:  # noqa: BLE001 - report, then leave without hanging at exit
        print(f"rank {os.environ.get('RANK')}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc()
        leave(1)
    leave(0)
