"""A torchrun-style script: ``main`` decorated with torch's ``@record``; rank 1 raises ValueError."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("boom at rank 1")


if __name__ == "__main__":
    main()
