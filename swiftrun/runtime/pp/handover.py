"""What a pipeline recovery hands to the ranks that replay: their stage checkpoints and the logs they replay from.

Every transfer is a (sender, receiver) pair; all ranks walk the same list in the same order (the plan's replay
sets, their members, the senders in rank order) and each carries out only its own pairs. The pair with the
lowest index not yet done always has both ends ready, so the hand-over cannot deadlock, although a rank may
both send (it holds a lost rank's checkpoint) and receive (it replays too).

Stage checkpoints also go to ``--stage-ckpt-dir`` when it is set (:class:`CheckpointDir`): written by a
background thread, atomically (temporary file, then rename), the previous one kept until the new one is
complete. It is the copy of last resort, for a rank whose in-memory holder was lost with it.
"""

from __future__ import annotations

import io
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from swiftrun.errors import RecoveryError
from swiftrun.runtime.pp.plan import DISK, PipePlan, Replay

if TYPE_CHECKING:
    from swiftrun.runtime.pp.pipeline import Pipeline
    from swiftrun.runtime.pp.ckpt import Packed

_TAG_SIZE, _TAG_DATA = 0x5717, 0x5718  # apart from the schedule's own traffic (tag 0)


def hand_over(pp: Pipeline, plan: PipePlan) -> Replay | None:
    """Carry out the plan's hand-over on this rank; enter replay mode if this rank replays. Returns its replay."""
    rank, device = pp.rec.rank, pp.rec.group.device()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # logged copies to pinned host memory are asynchronous
    mine = plan.replay_of(rank)
    checkpoint: torch.Tensor | None = None
    logs: dict = {}
    coll: dict = {}
    for replay in plan.replays:
        for member in replay.ranks:
            source = replay.source_of(member)
            senders = sorted(({source} - {member, DISK}) | set(replay.peers))
            for sender in senders:
                if rank == sender:
                    part = pp.part_for(replay, member, plan.point, checkpoint=sender == source,
                                       logs=sender in replay.peers,
                                       coll=bool(replay.peers) and sender == replay.peers[0])
                    send_obj(part, member, device)
                elif rank == member:
                    part = recv_obj(sender, device)
                    checkpoint = part.get("checkpoint", checkpoint)
                    logs.update(part.get("log", {}))
                    coll.update(part.get("coll", {}))
    if mine is None:
        return None
    source = mine.source_of(rank)
    if source == rank:
        own = pp.own_copy(mine.start)
        if own is None:
            raise RecoveryError(f"rank {rank} must roll back to its checkpoint of step {mine.start} but holds none")
        data = own
    elif source == DISK:
        assert pp.disk is not None
        data = pp.disk.read(rank, mine.start)
    else:
        if checkpoint is None:
            raise RecoveryError(f"rank {source} did not send the stage checkpoint of rank {rank}")
        data = checkpoint
    pp.enter_replay(mine, plan.point, data, logs, coll)
    return mine


def to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    # a view of the buffer, not a copy of it (a stage checkpoint is the size of the stage's state)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def _tag(device: torch.device, tag: int) -> dict:
    return {} if device.type == "cuda" else {"tag": tag}  # NCCL has no tags: order per pair is enough


def swap(data: torch.Tensor, to: int, frm: int, device: torch.device, group: Any = None) -> torch.Tensor:
    """Send ``data`` to ``to`` while receiving the same kind of message from ``frm`` (one step of a ring), on
    ``group`` (global ranks; None: the default group)."""
    size_out = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    size_in = torch.empty(1, dtype=torch.int64, device=device)
    for work in (dist.isend(size_out, to, group=group, **_tag(device, _TAG_SIZE)),
                 dist.irecv(size_in, frm, group=group, **_tag(device, _TAG_SIZE))):
        work.wait()
    inbound = torch.empty(int(size_in.item()), dtype=torch.uint8, device=device)
    for work in (dist.isend(data.to(device), to, group=group, **_tag(device, _TAG_DATA)),
                 dist.irecv(inbound, frm, group=group, **_tag(device, _TAG_DATA))):
        work.wait()
    return inbound.cpu()


def send_obj(obj: Any, to: int, device: torch.device) -> None:
    data = to_bytes(obj).to(device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), to, **_tag(device, _TAG_SIZE))
    dist.send(data, to, **_tag(device, _TAG_DATA))


def recv_obj(frm: int, device: torch.device) -> Any:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, frm, **_tag(device, _TAG_SIZE))
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, frm, **_tag(device, _TAG_DATA))
    return from_bytes(data)


class CheckpointDir:
    """Stage checkpoints on (shared) disk: ``rank{R}.step{S}.ckpt``, written in the background, atomically."""

    _NAME = re.compile(r"^rank(\d+)\.step(\d+)\.ckpt$")

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer: threading.Thread | None = None

    def write(self, rank: int, step: int, data: Packed) -> None:
        """Write in the background; a write still running is waited for first (one in flight per rank). ``data``
        must not change until :meth:`flush` returns."""
        if self._writer is not None:
            self._writer.join()
        self._writer = threading.Thread(target=self._write, args=(rank, step, data), daemon=True,
                                        name="swiftrun-stage-ckpt")
        self._writer.start()

    def flush(self) -> None:
        """Wait for the write in flight, if any."""
        if self._writer is not None:
            self._writer.join()

    def _write(self, rank: int, step: int, data: Packed) -> None:
        final = self.path / f"rank{rank}.step{step}.ckpt"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            data.write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        for old_step in self.steps(rank)[:-2]:  # keep the two newest: the previous one until this one exists
            (self.path / f"rank{rank}.step{old_step}.ckpt").unlink(missing_ok=True)

    def steps(self, rank: int) -> list[int]:
        found = []
        for name in os.listdir(self.path):
            match = self._NAME.match(name)
            if match and int(match.group(1)) == rank:
                found.append(int(match.group(2)))
        return sorted(found)

    def latest(self, rank: int) -> int:
        steps = self.steps(rank)
        return steps[-1] if steps else -1

    def read(self, rank: int, step: int) -> Packed:
        from swiftrun.runtime.pp.ckpt import Packed  # noqa: F811 - pp_ckpt imports this module

        path = self.path / f"rank{rank}.step{step}.ckpt"
        try:
            return Packed.parse(bytearray(path.read_bytes()))
        except (OSError, ValueError) as exc:
            raise RecoveryError(f"the stage checkpoint {path} cannot be read: {exc}") from exc
