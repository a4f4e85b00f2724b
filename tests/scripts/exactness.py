"""One small DDP training script with switches for every layout the exactness regression tests exercise.

Deterministic (seeded model and data), runnable under swiftrun, torchrun or alone; saves every rank's whole state
(parameters, all buffers, optimizer state, every param group's lr/momentum, scheduler, user state) to
--save-dir/rank{r}.pt. Each switch reproduces one way a recovery used to come out silently wrong.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import swiftrun


class Noisy(Dataset):
    """Map-style data whose samples draw from the worker's RNG (random augmentation)."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        x = torch.randn(8, generator=g) + 0.01 * torch.randn(8)  # the second term: "augmentation" noise
        return x, x[:2].sum(dim=0, keepdim=True)


def build(args) -> nn.Module:
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if args.bn:
        layers.append(nn.BatchNorm1d(16))
    layers.append(nn.ReLU())
    if args.dropout:
        layers.append(nn.Dropout(0.2))
    if args.wide:
        # more than DDP's 1 MiB first-bucket cap: its rebuild splits the one initial bucket into two
        layers += [nn.Linear(16, args.wide), nn.ReLU(), nn.Linear(args.wide, args.wide), nn.ReLU(),
                   nn.Linear(args.wide, 16), nn.ReLU()]
    layers.append(nn.Linear(16, 1))
    model = nn.Sequential(*layers)
    model.register_buffer("forward_calls", torch.zeros((), dtype=torch.int64), persistent=False)
    model.register_forward_pre_hook(lambda m, _: (m.forward_calls.add_(1), None)[1])
    if args.unused:
        model.register_parameter("unused_weight", nn.Parameter(torch.zeros(2)))  # never used: no gradient
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--bn", action="store_true")
    p.add_argument("--dropout", action="store_true")
    p.add_argument("--scheduler", choices=["none", "exponential", "onecycle"], default="none")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "adagrad"], default="adamw")
    p.add_argument("--register", choices=["ddp", "module", "compile"], default="ddp")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--wide", type=int, default=0, help="add a WIDE x WIDE layer (several rebuilt DDP buckets)")
    p.add_argument("--unused", action="store_true", help="a parameter without gradient (find_unused_parameters)")
    p.add_argument("--bucket-view", action="store_true")
    p.add_argument("--comm-hook", choices=["none", "before", "after"], default="none",
                   help="torch's allreduce_hook registered before or after swiftrun.Run")
    p.add_argument("--two-models", action="store_true", help="two DDP modules, two optimizers (GAN-shaped)")
    p.add_argument("--loader-workers", type=int, default=-1, help="-1: no DataLoader")
    p.add_argument("--ema", choices=["none", "registered", "unregistered"], default="none")
    p.add_argument("--sync-loss", action="store_true", help="all-reduce the loss after optimizer.step (inside)")
    p.add_argument("--tail-allreduce", action="store_true", help="a metric all-reduce after the guard")
    p.add_argument("--tail-barrier", action="store_true", help="rank 0 saves, then a barrier, after the guard")
    p.add_argument("--local-sgd", action="store_true", help="average parameters in place inside the step")
    p.add_argument("--accumulate-across", action="store_true", help="one iteration per micro-batch (refused)")
    args = p.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.save_dir, exist_ok=True)

    model = build(args)
    ddp = DDP(model, static_graph=args.static_graph, find_unused_parameters=args.unused,
              gradient_as_bucket_view=args.bucket_view)
    models: list = [ddp]
    params = list(model.parameters())
    if args.two_models:
        torch.manual_seed(args.seed + 1)
        critic = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
        models.append(DDP(critic))
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    elif args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    else:
        opt = torch.optim.Adagrad(params, lr=0.05)
    optimizers = [opt]
    if args.two_models:
        optimizers.append(torch.optim.SGD(models[1].parameters(), lr=0.05, momentum=0.5))
    scheduler = None
    if args.scheduler == "exponential":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    elif args.scheduler == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=args.steps + 1)
    ema = None
    if args.ema != "none":
        ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))

    registered_model = {"ddp": models if args.two_models else ddp, "module": model,
                        "compile": torch.compile(ddp, backend="eager")}[args.register]
    forward = registered_model if args.register == "compile" else ddp
    if args.comm_hook == "before":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    run = swiftrun.Run(model=registered_model, optimizer=optimizers, scheduler=scheduler,
                       state=ema if args.ema == "registered" else None)
    if args.comm_hook == "after":  # swiftrun installed its own already: DDP allows one per reducer
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    loader = None
    if args.loader_workers >= 0:
        sampler = swiftrun.ResumableDistributedSampler(Noisy(), shuffle=True, seed=args.seed)
        loader = DataLoader(Noisy(), batch_size=4, sampler=sampler, num_workers=args.loader_workers)
    steps = run.steps(args.steps, loader=loader) if loader is not None else ((s, None) for s in run.steps(args.steps))
    metrics = []
    for step, batch in steps:
        with run.guard():
            if batch is None:
                g = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + rank)
                x = torch.randn(8, 8, generator=g)
                batch = (x, x[:, :2].sum(dim=1, keepdim=True))
            if not args.accumulate_across or step % 2 == 0:
                for opt_ in optimizers:
                    opt_.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(forward(batch[0]), batch[1])
            if args.two_models:
                loss = loss + models[1](loss.detach().reshape(1, 1)).pow(2).sum()
            loss.backward()
            if not args.accumulate_across or step % 2 == 1:
                for opt_ in optimizers:
                    opt_.step()
            if scheduler is not None:
                scheduler.step()
            if ema is not None:
                ema.update_parameters(model)
            if args.local_sgd and step % 3 == 2:
                with torch.no_grad():
                    for prm in params:
                        dist.all_reduce(prm)
                        prm.div_(world)
            if args.sync_loss:
                dist.all_reduce(loss.detach())
        if args.tail_allreduce:
            metric = loss.detach().clone()
            dist.all_reduce(metric)
            metrics.append(float(metric))
        if args.tail_barrier and step % 4 == 3:
            if rank == 0 and not run.aborted:
                torch.save(model.state_dict(), os.path.join(args.save_dir, "checkpoint.pt"))
            dist.barrier()

    os.makedirs(args.save_dir, exist_ok=True)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"buffer.{k}": v for k, v in model.named_buffers()})
    for i, o in enumerate(optimizers):
        for pid, entries in o.state_dict()["state"].items():
            state.update({f"opt{i}.{pid}.{k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)})
        for j, group in enumerate(o.param_groups):
            state[f"opt{i}.group{j}.lr"] = torch.tensor(float(group["lr"]))
            if "momentum" in group:
                state[f"opt{i}.group{j}.momentum"] = torch.tensor(float(group["momentum"]))
    if args.two_models:
        state.update({f"critic.{k}": v for k, v in models[1].module.state_dict().items()})
    if ema is not None:
        state.update({f"ema.{k}": v for k, v in ema.state_dict().items()})
    torch.save(state, os.path.join(args.save_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
