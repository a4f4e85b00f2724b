"""A tiny recoverable DDP job whose rank 1 is SIGKILLed after training, while "saving" (argv[1]: a directory).

After ``run.steps`` returns, every rank finished its loop and the launcher released them all. Rank 1 then
dies; the others save their result and meet in a barrier, which without the launcher's abort would wait for the
dead rank (a barrier after a save is common). Each rank writes ``<rank>.saved`` once its file is written.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import swiftrun

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run = swiftrun.Run(model=model, optimizer=optimizer)
for step in run.steps(4):
    with run.guard():
        loss = model(torch.full((2, 4), float(step + rank))).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

if rank == 1:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # e.g. the OOM killer, while it writes its final file
torch.save(model.module.state_dict(), os.path.join(out, f"rank{rank}.pt"))
with open(os.path.join(out, f"{rank}.saved"), "w") as f:
    f.write("ok")
dist.barrier()
dist.destroy_process_group()
