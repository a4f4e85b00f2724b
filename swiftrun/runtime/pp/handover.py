"""What a pipeline recovery hands to the ranks that replay: their stage checkpoints and the logs they replay from.

Every transfer is a (sender, receiver) pair; all ranks walk the same list in the same order (the plan's replay
sets, their members, the senders in rank order) and each carries out only its own pairs. The pair with the
lowest index not yet done always has both ends ready, so the hand-over cannot deadlock, although a rank may
both send (it holds a lost rank's checkpoint) and receive (it replays too).

The stage checkpoints come from the neighbours' memory, or from ``--stage-ckpt-dir``
(:class:`~swiftrun.runtime.pp.ckpt.CheckpointDir`), the copy of last resort for a rank whose in-memory holder was
lost with it.
"""

from __future__ import annotations

import torch

from swiftrun.errors import RecoveryError
from swiftrun.runtime.pp.pipeline import Pipeline
from swiftrun.runtime.pp.plan import DISK, PipePlan, Replay
from swiftrun.runtime.pp.wire import recv_obj, send_obj

def hand_over(pp: Pipeline, plan: PipePlan) -> Replay | None:
    """Carry out the plan's hand-over on this rank; enter replay mode if this rank replays. Returns its replay."""
    rank, device = pp.view.rank, pp.group.device()
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
