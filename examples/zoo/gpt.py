"""A tiny GPT-style language model on synthetic token sequences: AdamW with decay/no-decay param groups,
warmup-cosine LambdaLR, grad clipping, gradient accumulation of 2 micro-batches inside the step (DDP no_sync on
the first), dropout, and a map-style dataset read through a DataLoader (one worker process) with
swiftrun.ResumableDistributedSampler, consumed via ``run.steps(N, loader=loader)``.

    torchrun --nproc-per-node 2 examples/zoo/gpt.py --steps 40 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/gpt.py --steps 40 --save-dir out/
    python examples/zoo/gpt.py --steps 40 --save-dir out/

What a recovery must get right here: dropout masks (the global torch RNG, which DataLoader iteration also
draws from), the sampler's position across epochs (the dataset is small, so the run crosses several epochs),
accumulated gradients of a half-done step, and the LambdaLR-driven lr of two param groups.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import swiftrun
from _common import final_state, generator, init_distributed, save_final


class Tokens(Dataset):
    """Sequence i is a pure function of (seed, i): a noisy affine recurrence modulo the vocabulary."""

    def __init__(self, size: int, length: int, vocab: int, seed: int) -> None:
        self.size, self.length, self.vocab, self.seed = size, length, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        g = generator(self.seed, 7, index)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = 1 + index % 5
        seq = (start + stride * torch.arange(self.length)) % self.vocab
        noise = torch.rand(self.length, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, self.vocab, (self.length,), generator=g), seq)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("causal", torch.triu(torch.full((length, length), float("-inf")), diagonal=1),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for block in self.blocks:
            x = block(x, self.causal[:t, :t])
        return self.out(self.ln(x))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok" not in n and "pos" not in n]
    ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--dataset", type=int, default=96, help="sequences in the dataset (small: many epochs)")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=48)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.length, args.dim, args.layers, args.heads, args.dropout)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, args.steps // 8), args.steps))

    dataset = Tokens(args.dataset, args.length + 1, args.vocab, args.seed)
    sampler = swiftrun.ResumableDistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.micro_batch * args.accum, sampler=sampler,
                        num_workers=args.workers, drop_last=True)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler)

    for step, batch in run.steps(args.steps, loader=loader):
        with run.guard():
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for micro, chunk in enumerate(batch.chunk(args.accum)):
                inputs, targets = chunk[:, :-1], chunk[:, 1:]
                last = micro == args.accum - 1
                with ddp_model.no_sync() if not last else contextlib.nullcontext():  # all-reduce on the last only
                    logits = ddp_model(inputs)
                    loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
                    (loss / args.accum).backward()
                total += loss.item() / args.accum
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            run.report(loss=total, lr=scheduler.get_last_lr()[0])

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
