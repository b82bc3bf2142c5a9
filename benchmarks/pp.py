"""Pipeline bubble and activation memory at pp=2: measured next to the formulas.

    python benchmarks/pp.py

Runs every schedule at pp=2 (2 processes, gloo, one thread each; Llama h=256, 8 layers,
microbatch 2 x 128, m=8) and prints per-rank measured idle share of the step (step time minus time
inside the stages' forward/backward/loss calls) next to the unit-cost simulation and the published
formula ((p-1)/(m+p-1) for GPipe/1F1B; (p-1)/(v*m+p-1) for interleaved, the share-of-step form of
Narayanan et al.'s (p-1)/(v*m)). The measurement code lives with the pipeline tests
(tests/test_pipeline.py, mode "bubble"); saved-activation bytes of 1F1B vs GPipe are asserted there.
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bubble"]
    runpy.run_path(str(Path(__file__).resolve().parent.parent / "tests" / "test_pipeline.py"), run_name="__main__")
