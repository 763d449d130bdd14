"""The wire of the rollout ranks' in-flight state under separate placement: what a checkpoint
keeps of them (each rank's finished parts the trainer has not taken, its sampler's streams and
the loader position of its next draw; `megagrpo.rollout.serve.save_in_flight`), sent to
training rank 0 as the checkpoint is written and back to each rollout rank with a resumed
launch's first sync (`megagrpo.rollout.placement`'s module docstring, "resume")."""
from __future__ import annotations

import json
import math

import torch

TAG_STATE = 1
"""The samples group's tag of a rollout rank's in-flight state (to and from training rank 0);
the finished parts travel under the sample channel's tag 0."""


# ---------------------------------------------------------------------- in-flight state
def send_state(pg, dst: int, state: dict) -> None:
    """An in-flight state ({"next", "loader": JSON-able, "rng": name -> tensor, "parts": uint8
    packed parts}) to rank `dst` of `pg` (the samples group, `TAG_STATE`): a JSON header and
    one flat buffer."""
    blobs = [*state["rng"].values(), *state["parts"]]
    head = {"next": state["next"], "loader": state["loader"], "out": state.get("out", False),
            "rng": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in state["rng"].items()],
            "parts": [t.numel() for t in state["parts"]]}
    data = json.dumps(head).encode()
    flat = torch.cat([torch.frombuffer(bytearray(data), dtype=torch.uint8),
                      *(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                        for t in blobs)])
    pg.send([torch.tensor([len(data), flat.numel()], dtype=torch.int64)], dst, TAG_STATE).wait()
    pg.send([flat], dst, TAG_STATE).wait()


def receive_state(pg, src: int) -> dict:
    """The in-flight state rank `src` of `pg` sent (`send_state`)."""
    n = torch.empty(2, dtype=torch.int64)
    pg.recv([n], src, TAG_STATE).wait()
    flat = torch.empty(int(n[1]), dtype=torch.uint8)
    pg.recv([flat], src, TAG_STATE).wait()
    off = int(n[0])
    head = json.loads(flat[:off].numpy().tobytes().decode())
    rng = {}
    for name, dtype, shape in head["rng"]:
        dt = getattr(torch, dtype)
        size = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        rng[name] = flat[off:off + size].clone().view(dt).reshape(shape)
        off += size
    parts = []
    for size in head["parts"]:
        parts.append(flat[off:off + size].clone())
        off += size
    return {"next": head["next"], "loader": head["loader"], "rng": rng, "parts": parts,
            "out": head.get("out", False)}


