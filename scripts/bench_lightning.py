#!/usr/bin/env python
"""PyTorch Lightning under ``swiftrun.lightning.SwiftDDPStrategy`` (examples/zoo/lightning_ddp.py, 2 ranks):
failure-free update time under swiftrun vs torchrun, and one in-place recovery's phases.

Update time: interleaved failure-free runs of each launcher (order alternating per repetition), rank 0's mean
time per optimizer update (an accumulation window of 2 micro-batches) after a warm-up
(``lightning_ddp: steps=N step_ms=X``). Under torchrun the strategy is Lightning's DDPStrategy unchanged, so this is
the cost of the integration plus swiftrun's step transaction.

Recovery: rank 1 SIGKILLed by an injected fault in the first forward of update ``--kill-step``; the event log's
phases and the kill-to-resumed total, per run, and whether every rank ends bitwise as the failure-free run.

    python scripts/bench_lightning.py              # 5 x 200 updates, hidden 1024, 512 features, batch 32
    python scripts/bench_lightning.py --quick      # smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402
import bench_hf  # noqa: E402 - the same benchmark, over the Lightning example

SCRIPT = B.REPO / "examples" / "zoo" / "lightning_ddp.py"


def main() -> None:
    bench_hf.bench(bench_hf.parse_args(__doc__), SCRIPT, "Lightning Trainer")


if __name__ == "__main__":
    main()
