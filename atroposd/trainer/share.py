"""A step's share of one trainer rank (SPEC §12.1): rank 0 deals a batch's micro-batches
round-robin (``deal``) and sends each other rank its part as checked data — a JSON header of dtypes
and shapes and one flat uint8 tensor of the bytes (``encode_share`` / ``decode_share``); nothing a
rank receives is unpickled."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from atroposd.trainer.batch import MicroBatch
from atroposd.trainer.group import BadCommand

__all__ = ["MAX_HEADER_BYTES", "Share", "deal", "decode_share", "encode_share"]


@dataclass
class Share:
    """One rank's part of a step: its micro-batches and what the whole batch is normalised by."""

    micro: list[MicroBatch]
    passes: int  # every rank runs this many; passes past len(micro) run on ``pad`` with weight 0
    pad: MicroBatch | None
    denom: int  # completion tokens of the whole batch
    distill_positions: int  # distillation positions of the whole batch

    def passes_with_weight(self) -> list[tuple[MicroBatch, float]]:
        out = [(mb, 1.0) for mb in self.micro]
        if len(out) < self.passes:
            assert self.pad is not None, "a zero-weight pass needs a micro-batch to run on"
            out += [(self.pad, 0.0)] * (self.passes - len(out))
        return out


def deal(micro: Sequence[MicroBatch], world: int, denom: int, distill_positions: int) -> list[Share]:
    """Round-robin micro-batches over ``world`` ranks; every rank gets the same number of passes."""
    parts = [list(micro[r::world]) for r in range(world)]
    passes = max((len(p) for p in parts), default=0)
    pad = micro[0] if micro else None
    return [Share(p, passes, pad if len(p) < passes else None, denom, distill_positions) for p in parts]


# The largest JSON header (a share's, a broadcast value) a rank accepts.
MAX_HEADER_BYTES = 1 << 24
# The dtypes a share's tensors may have.
_SHARE_DTYPES = {
    str(d): d
    for d in (
        torch.int64,
        torch.int32,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.bool,
        torch.uint8,
    )
}


def _micro_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(MicroBatch)]


def encode_share(share: Share) -> tuple[bytes, torch.Tensor]:
    """A share as a JSON header (its numbers; each micro-batch's tensors as dtype and shape, in
    field order) and one flat uint8 tensor of the tensors' bytes (on the CPU)."""
    parts: list[torch.Tensor] = []

    def micro(mb: MicroBatch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _micro_fields():
            t = getattr(mb, name)
            if t is None:
                out[name] = None
                continue
            t = t.detach().cpu().contiguous()
            out[name] = [str(t.dtype), list(t.shape)]
            parts.append(t.reshape(-1).view(torch.uint8))
        return out

    header = {
        "passes": share.passes,
        "denom": share.denom,
        "distill_positions": share.distill_positions,
        "micro": [micro(mb) for mb in share.micro],
        "pad": None if share.pad is None else micro(share.pad),
    }
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return json.dumps(header, separators=(",", ":")).encode(), data


def _count(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadCommand(f"a share's {what} must be a count")
    return v


def decode_share(header: bytes, data: torch.Tensor) -> Share:
    """The share in a header and its bytes, checked: the fields a micro-batch has, known dtypes,
    shapes of counts, and exactly as many bytes as they take. :class:`BadCommand` otherwise."""
    try:
        h = json.loads(header)
    except ValueError as exc:
        raise BadCommand("a share's header is not JSON") from exc
    if not isinstance(h, dict) or set(h) != {"passes", "denom", "distill_positions", "micro", "pad"}:
        raise BadCommand("a share's header is malformed")
    if not isinstance(h["micro"], list):
        raise BadCommand("a share's micro-batches must be a list")
    names = _micro_fields()
    offset = 0
    flat = data.reshape(-1)

    def micro(spec: object) -> MicroBatch:
        nonlocal offset
        if not isinstance(spec, dict) or set(spec) != set(names):
            raise BadCommand("a share's micro-batch has other fields than a micro-batch")
        values: dict[str, torch.Tensor | None] = {}
        for name in names:
            item = spec[name]
            if item is None:
                values[name] = None
                continue
            if not (
                isinstance(item, list) and len(item) == 2 and item[0] in _SHARE_DTYPES and isinstance(item[1], list)
            ):
                raise BadCommand(f"a share's tensor {name}: bad dtype or shape")
            dtype, shape = _SHARE_DTYPES[item[0]], [_count(d, "shape") for d in item[1]]
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if offset + n > flat.numel():
                raise BadCommand("a share has fewer bytes than its tensors take")
            values[name] = flat[offset : offset + n].clone().view(dtype).reshape(shape)
            offset += n
        if any(values[n] is None for n in names[:6]):
            raise BadCommand("a share's micro-batch lacks a required tensor")
        return MicroBatch(**values)  # type: ignore[arg-type]

    micros = [micro(m) for m in h["micro"]]
    pad = None if h["pad"] is None else micro(h["pad"])
    if offset != flat.numel():
        raise BadCommand("a share has more bytes than its tensors take")
    passes = _count(h["passes"], "passes")
    if passes < len(micros) or (passes > len(micros) and pad is None):
        raise BadCommand("a share's passes do not match its micro-batches")
    return Share(micros, passes, pad, _count(h["denom"], "denom"), _count(h["distill_positions"], "distill_positions"))
