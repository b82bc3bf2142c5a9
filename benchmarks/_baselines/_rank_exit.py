"""The end of a baseline worker under torchrun: run, write the result, leave without hanging.

gloo aborts at interpreter exit unless the process group is destroyed (and now and then even
then), so a worker writes its result (rank 0), meets the others at a barrier, destroys the group
and leaves with os._exit; a failing rank prints its error and exits 1 so torchrun stops the rest.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable


def run_rank_and_exit(work: Callable[[], dict], out_path: str) -> None:
    import torch.distributed as dist

    code = 0
    try:
        result = work()
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - report, then leave without hanging at exit
        print(f"rank {os.environ.get('RANK')}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc()
        code = 1
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
