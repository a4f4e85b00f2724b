"""Each rank's own RNG streams: backed up to its agent, restored from there for its replacement.

Scripts often give every rank a stream of its own (``torch.manual_seed(seed + rank)`` for dropout, per-rank
augmentation). Such state differs between replicas by design, so a replacement cannot take it from the rank it
copies the model from: before this module it did, both ranks then drew the same masks, and the recovery was
reported exact while the run ended 1.2 relative off.

- **Backup.** At each step start every rank sends the streams of that step's start (Python, NumPy once imported,
  torch CPU, CUDA once initialised: 5-15 KB) to the launcher over its control link (an ``RNG_BACKUP`` event),
  and again as its first optimizer step of the step begins, labelled as the next step's start (a failure during
  or after the update, which the survivors may roll forward past, needs that one; optimizers draw nothing, and a
  script that draws after its update is noticed at its next step start, whose backup then differs). The launcher keeps the last few per rank;
  it never looks inside, except to see whether two ranks' streams of the same step differ (then the job has
  per-rank streams, and every RECOVER says so).
- **Restore.** A replacement gets its rank's backups with the RECOVER command. Every rank then takes *its own*
  streams of the step to redo when the job has per-rank streams: a survivor from its step snapshot (or its live
  streams, standing between steps), a replacement from the backup. When the job's streams are replica-equal, a
  receiving rank takes the source's, as before.
- **Loud where not exact.** A rank whose own streams for that step exist nowhere (it died before that step's
  backup reached the launcher; a survivor that was behind the recovery point) continues with the source's
  streams and says so: a WARNING naming the rank and the step, in its log, the dashboard and the event log.

The streams are encoded for JSON (the control protocol's codec) as base64 strings: about 10 KB per backup with
NumPy imported, 7 KB without; the launcher holds two per rank.
"""

from __future__ import annotations

import array
import base64
from typing import Any

import torch




def encode(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`~swiftrun.runtime.core.txn.rng_state`'s dict -> a JSON-able dict."""
    out: dict[str, Any] = {"torch": _b64(state["torch"])}
    version, internal, gauss_next = state["python"]
    out["python"] = [version, _b64_words(internal), gauss_next]
    if "numpy" in state:
        name, key, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = [name, _b64_words(key), int(pos), int(has_gauss), float(cached)]
    if "cuda" in state:
        out["cuda"] = [_b64(s) for s in state["cuda"]]
    return out


def decode(data: dict[str, Any]) -> dict[str, Any]:
    """:func:`encode`'s output -> a state :func:`~swiftrun.runtime.core.txn.set_rng_state` takes."""
    version, internal, gauss_next = data["python"]
    state: dict[str, Any] = {"python": (version, tuple(_words(internal)), gauss_next), "torch": _tensor(data["torch"])}
    if "numpy" in data:
        import numpy as np

        name, key, pos, has_gauss, cached = data["numpy"]
        state["numpy"] = (name, np.array(_words(key), dtype=np.uint32), pos, has_gauss, cached)
    if "cuda" in data:
        state["cuda"] = [_tensor(s) for s in data["cuda"]]
    return state


def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two decoded states are the same streams (None: unknown, never the same)."""
    if a is None or b is None:
        return False
    return encode(a) == encode(b)


def choose(own: dict[str, Any] | None, shared: dict[str, Any], *, per_rank: bool,
           receives: bool) -> tuple[dict[str, Any], bool]:
    """The streams a rank redoes the recovery's next step with, and whether they are known to be exact.

    ``own``: this rank's own streams of that step's start, if it has them; ``shared``: the source's;
    ``per_rank``: the job's ranks have streams of their own; ``receives``: this rank takes the source's state.
    """
    if per_rank:
        return (own, True) if own is not None else (shared, False)
    if own is not None and not receives:
        return own, True
    return shared, True


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _b64_words(words: Any) -> str:
    """Mersenne Twister words (Python's 624 + its position, NumPy's key) as base64 of unsigned 32-bit integers:
    a third of their JSON list's size, and one string instead of 625 integer objects in the launcher."""
    raw = words.astype("=u4").tobytes() if hasattr(words, "astype") else array.array("I", words).tobytes()
    return base64.b64encode(raw).decode("ascii")


def _words(text: str) -> list[int]:
    return array.array("I", base64.b64decode(text)).tolist()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
