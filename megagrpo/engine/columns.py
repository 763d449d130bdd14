"""A batch of `Completion`s held as columns: flat tensors of every per-token field (token ids,
log-probs, loss masks, per-token versions, MoE routes) and one row per completion of its
scalars, in place of one Python list per completion and field.

10,000 completions of 4,096 tokens are 41M token ids and as many log-probs: as Python lists
(`Completion.token_ids`, `.logprobs`) about 2.8 GB, as an int32 and a float32 tensor 330 MB.
Separate placement's sample channel (`megagrpo.rollout.sample_channel`) sends these columns as
they are and the training ranks receive them as views of the received buffer; the trainer's
batch builder (`megagrpo.train.advantage.build_batch`) reads them row by row as tensor views.
Everything else may treat a `SampleColumns` as a read-only sequence of `Completion`s: item k
is made on access (its lists built then, for that completion only).
"""
from __future__ import annotations

import array
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megagrpo.engine.types import NO_VERSION, Completion

INT_COLUMNS = ("prompt_index", "sample_index", "version", "turns", "tool_calls", "tool_errors",
               "tokens", "token_versions", "loss_mask", "turn_rewards", "finish_reason",
               "truncation", "correct", "routes", "text", "env_retries", "dropped")
"""The int64 columns of `SampleColumns.ints`, in this order. `tokens`: len(token_ids);
`token_versions` / `loss_mask`: 1 when the completion has them; `turn_rewards`: their count,
-1 for None; `finish_reason` / `truncation` / `dropped`: index into `SampleColumns.vocab`;
`correct`: -1 None, 0, 1; `routes`: the routes tensor's rank (0: None); `text`: its UTF-8
byte count."""
FLOAT_COLUMNS = ("tool_seconds", "env_reward")
"""The float64 columns of `SampleColumns.floats`."""
VOCAB_COLUMNS = ("finish_reason", "truncation", "dropped")
FLAT_FIELDS = ("token_ids", "logprobs", "token_versions", "loss_mask", "turn_rewards",
               "route_shapes", "routes", "text")
"""The flat tensors, each the rows' pieces one after another (`SampleColumns.offsets`)."""
_COL = {name: k for k, name in enumerate(INT_COLUMNS)}


@dataclass(frozen=True, eq=False)
class SampleColumns(Sequence):
    """n completions as columns (module docstring). Immutable: the methods return new ones."""

    ints: torch.Tensor
    """[n, len(INT_COLUMNS)] int64."""
    floats: torch.Tensor
    """[n, len(FLOAT_COLUMNS)] float64."""
    token_ids: torch.Tensor
    """[sum tokens] int32."""
    logprobs: torch.Tensor
    """[sum tokens] float32 when every value is a float32 (vLLM's are), else float64."""
    token_versions: torch.Tensor
    """[sum tokens of the rows that have them] int64."""
    loss_mask: torch.Tensor
    """[sum tokens of the rows that have one] bool."""
    turn_rewards: torch.Tensor
    """[sum of the turn-reward counts] float64."""
    route_shapes: torch.Tensor
    """[sum of the routes' ranks] int64: each routed row's routes shape."""
    routes: torch.Tensor
    """[sum of the routes' sizes] (int16, as captured): each routed row's routes, flat."""
    text: torch.Tensor
    """[sum of the texts' UTF-8 bytes] uint8."""
    vocab: dict[str, tuple[str, ...]]
    """VOCAB_COLUMNS -> the strings their int columns index."""

    # ------------------------------------------------------------------ building
    @classmethod
    def of(cls, comps: Sequence[Completion]) -> SampleColumns:
        """`comps` as columns (itself when it is already)."""
        return comps if isinstance(comps, SampleColumns) else cls.from_completions(comps)

    @classmethod
    def from_completions(cls, comps: Sequence[Completion]) -> SampleColumns:
        """The columns of `comps` (checked: every per-token field as long as the token ids,
        token ids in int32)."""
        _check(comps)
        vocab = {v: tuple(sorted({getattr(c, v) for c in comps})) for v in VOCAB_COLUMNS}
        index = {v: {s: k for k, s in enumerate(vocab[v])} for v in VOCAB_COLUMNS}
        texts = [c.text.encode() for c in comps]
        ints = torch.tensor([[
            c.prompt_index, c.sample_index, c.version, c.turns, c.tool_calls, c.tool_errors,
            len(c.token_ids), c.token_versions is not None, c.loss_mask is not None,
            -1 if c.turn_rewards is None else len(c.turn_rewards),
            index["finish_reason"][c.finish_reason], index["truncation"][c.truncation],
            -1 if c.correct is None else int(c.correct),
            0 if c.routes is None else c.routes.dim(), len(t), c.env_retries,
            index["dropped"][c.dropped]] for c, t in zip(comps, texts)],
            dtype=torch.int64).reshape(len(comps), len(INT_COLUMNS))
        floats = torch.tensor([[c.tool_seconds, c.env_reward] for c in comps],
                              dtype=torch.float64).reshape(len(comps), len(FLOAT_COLUMNS))
        ids = _flat("q", (c.token_ids for c in comps), torch.int64)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < 2 ** 31:
            raise ValueError(f"a token id outside int32 ({int(ids.min())}..{int(ids.max())}): "
                             "the sample columns hold ids as int32")
        logprobs = _flat("d", (c.logprobs for c in comps), torch.float64)
        if _exact_float32(logprobs):
            logprobs = logprobs.to(torch.float32)
        routes = [c.routes for c in comps if c.routes is not None]
        return cls(
            ints=ints, floats=floats, token_ids=ids.to(torch.int32), logprobs=logprobs,
            token_versions=_flat("q", (c.token_versions for c in comps
                                       if c.token_versions is not None), torch.int64),
            loss_mask=_flat("b", (c.loss_mask for c in comps if c.loss_mask is not None),
                            torch.int8).to(torch.bool),
            turn_rewards=_flat("d", (c.turn_rewards for c in comps
                                     if c.turn_rewards is not None), torch.float64),
            route_shapes=torch.tensor([s for r in routes for s in r.shape], dtype=torch.int64),
            routes=(torch.cat([r.reshape(-1) for r in routes]) if routes
                    else torch.empty(0, dtype=torch.int16)),
            text=torch.frombuffer(bytearray(b"".join(texts)) or bytearray(1),
                                  dtype=torch.uint8)[:sum(map(len, texts))],
            vocab=vocab)

    @classmethod
    def gather(cls, sources: Sequence[SampleColumns], picks: Sequence[tuple[int, int]]
               ) -> SampleColumns:
        """New columns of the rows `picks` = [(source index, row)], in that order (one copy of
        each field; runs of consecutive rows of one source are copied as one piece)."""
        vocab = {v: tuple(sorted({s for src in sources for s in src.vocab[v]}))
                 for v in VOCAB_COLUMNS}
        ints = [src._ints_in(vocab) for src in sources]
        runs: list[tuple[int, int, int]] = []  # (source, first row, end row)
        for s, r in picks:
            if runs and runs[-1][0] == s and runs[-1][2] == r:
                runs[-1] = (s, runs[-1][1], r + 1)
            else:
                runs.append((s, r, r + 1))
        out = {"ints": _cat([ints[s][a:b] for s, a, b in runs], ints[0] if ints else None,
                            (0, len(INT_COLUMNS)), torch.int64),
               "floats": _cat([sources[s].floats[a:b] for s, a, b in runs],
                              sources[0].floats if sources else None,
                              (0, len(FLOAT_COLUMNS)), torch.float64)}
        for name in FLAT_FIELDS:
            like = [getattr(src, name) for src in sources]
            pieces = [like[s][sources[s].offsets(name)[a]:sources[s].offsets(name)[b]]
                      for s, a, b in runs]
            out[name] = _cat([p for p in pieces if p.numel()], like[0] if like else None,
                             (0,), _default_dtype(name, like))
        return cls(**out, vocab=vocab)

    @classmethod
    def concat(cls, parts: Sequence[SampleColumns]) -> SampleColumns:
        """The rows of every part, in order."""
        return cls.gather(parts, [(s, r) for s, p in enumerate(parts) for r in range(len(p))])

    def take(self, rows: Sequence[int]) -> SampleColumns:
        """These rows, in this order (itself when that is every row in order)."""
        rows = list(rows)
        if rows == list(range(len(self))):
            return self
        return SampleColumns.gather([self], [(0, r) for r in rows])

    def with_versions(self, versions: dict[int, int]) -> SampleColumns:
        """Every completion's version (and per-token version) v replaced by versions[v]."""
        lut = self._version_lut(versions)
        ints = self.ints.clone()
        ints[:, _COL["version"]] = _looked_up(ints[:, _COL["version"]], lut)
        return _replace(self, ints=ints, token_versions=_looked_up(self.token_versions, lut))

    def shift_and_map_(self, delta: int, versions: dict[int, int] | None) -> None:
        """In place, on columns no one else holds (a fresh `gather`): every prompt_index moved
        by `delta`, and with `versions` every version mapped as `with_versions` maps it."""
        self.ints[:, _COL["prompt_index"]] += delta
        if versions is not None:
            lut = self._version_lut(versions)
            self.ints[:, _COL["version"]] = _looked_up(self.ints[:, _COL["version"]], lut)
            tv = self.token_versions
            for a in range(0, tv.numel(), 1 << 20):  # chunks: no second copy of them all
                tv[a:a + (1 << 20)] = _looked_up(tv[a:a + (1 << 20)], lut)

    def with_prompts_shifted(self, delta: int) -> SampleColumns:
        """Every prompt_index moved by `delta`."""
        ints = self.ints.clone()
        ints[:, _COL["prompt_index"]] += delta
        return _replace(self, ints=ints)

    # ------------------------------------------------------------------ reading
    def _version_lut(self, versions: dict[int, int]) -> torch.Tensor:
        """versions as a lookup tensor; a version with no mapping looks up `_UNMAPPED`."""
        lut = torch.full((max(versions, default=-1) + 2,), _UNMAPPED, dtype=torch.int64)
        lut[NO_VERSION] = NO_VERSION  # an environment's token (multi-turn partial rollouts)
        for k, v in versions.items():
            lut[k] = v  # a key of -1 lands in the last slot, as -1 indexes it
        return lut

    def __len__(self) -> int:
        return self.ints.shape[0]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.take(range(len(self))[k])
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"completion {k} of {n}")
        return self._completion(k % n)

    def __iter__(self):
        return (self._completion(k) for k in range(len(self)))

    def __add__(self, other) -> list[Completion]:
        """A list of the completions of both (as `list + list` would give)."""
        return list(self) + list(other)

    def __radd__(self, other) -> list[Completion]:
        return list(other) + list(self)

    def column(self, name: str) -> torch.Tensor:
        """[n] int64: an INT_COLUMNS column."""
        return self.ints[:, _COL[name]]

    def is_value(self, name: str, value: str) -> torch.Tensor:
        """[n] bool: a VOCAB_COLUMNS column equals `value`."""
        if value not in self.vocab[name]:
            return torch.zeros(len(self), dtype=torch.bool)
        return self.column(name) == self.vocab[name].index(value)

    def model_lengths(self) -> torch.Tensor:
        """[n] int64: tokens sampled by the model (all, or the loss mask's True ones)."""
        out = self.column("tokens").clone()
        masked = self.column("loss_mask").bool()
        if bool(masked.any()):
            o = self.offsets("loss_mask")
            sums = torch.cat([torch.zeros(1, dtype=torch.int64),
                              self.loss_mask.to(torch.int64).cumsum(0)])
            out[masked] = (sums[o[1:]] - sums[o[:-1]])[masked]
        return out

    def rows(self, name: str) -> list[torch.Tensor | None]:
        """Per row, its piece of the flat field `name` as a view (token_ids, logprobs,
        token_versions, loss_mask, turn_rewards; None for a row without that field)."""
        o, flat = self.offsets(name).tolist(), getattr(self, name)
        present = {"token_versions": "token_versions", "loss_mask": "loss_mask",
                   "turn_rewards": "turn_rewards"}.get(name)
        has = [True] * len(self) if present is None else (
            self.column(present) >= (0 if name == "turn_rewards" else 1)).tolist()
        return [flat[o[k]:o[k + 1]] if has[k] else None for k in range(len(self))]

    def route_rows(self) -> list[torch.Tensor | None]:
        """Per row, its routes tensor (a view) or None."""
        o, shapes = self.offsets("routes").tolist(), self._route_shapes
        return [None if shapes[k] is None else self.routes[o[k]:o[k + 1]].view(shapes[k])
                for k in range(len(self))]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (the wire's order)."""
        return {"ints": self.ints, "floats": self.floats,
                **{name: getattr(self, name) for name in FLAT_FIELDS}}

    def offsets(self, name: str) -> torch.Tensor:
        """[n + 1] int64: row k's piece of flat field `name` is [offsets[k], offsets[k+1])."""
        return self._offsets[name]

    # ------------------------------------------------------------------ internals
    @functools.cached_property
    def _offsets(self) -> dict[str, torch.Tensor]:
        c = self.column
        tokens = c("tokens")
        counts = {"token_ids": tokens, "logprobs": tokens,
                  "token_versions": tokens * c("token_versions"),
                  "loss_mask": tokens * c("loss_mask"),
                  "turn_rewards": c("turn_rewards").clamp(min=0),
                  "route_shapes": c("routes"), "text": c("text"),
                  "routes": torch.tensor([0 if s is None else math.prod(s)
                                          for s in self._route_shapes], dtype=torch.int64)}
        return {k: torch.cat([torch.zeros(1, dtype=torch.int64), v.cumsum(0)])
                for k, v in counts.items()}

    @functools.cached_property
    def _route_shapes(self) -> list[tuple[int, ...] | None]:
        dims, flat, out, at = self.column("routes").tolist(), self.route_shapes.tolist(), [], 0
        for d in dims:
            out.append(tuple(flat[at:at + d]) if d else None)
            at += d
        return out

    @functools.cached_property
    def _int_rows(self) -> list[list[int]]:
        return self.ints.tolist()

    def _ints_in(self, vocab: dict[str, tuple[str, ...]]) -> torch.Tensor:
        """`ints` with the vocabulary columns re-indexed into `vocab` (a superset of ours)."""
        if all(self.vocab[v] == vocab[v] for v in VOCAB_COLUMNS):
            return self.ints
        ints = self.ints.clone()
        for v in VOCAB_COLUMNS:
            lut = torch.tensor([vocab[v].index(s) for s in self.vocab[v]] or [0],
                               dtype=torch.int64)
            ints[:, _COL[v]] = lut[ints[:, _COL[v]]]
        return ints

    def _completion(self, k: int) -> Completion:
        r = dict(zip(INT_COLUMNS, self._int_rows[k]))
        seg = {name: self.offsets(name)[k:k + 2].tolist() for name in FLAT_FIELDS}

        def piece(name: str) -> torch.Tensor:
            a, b = seg[name]
            return getattr(self, name)[a:b]

        tool_s, env_r = self.floats[k].tolist()
        routes = None
        if r["routes"]:
            routes = piece("routes").clone().view(self._route_shapes[k])
        return Completion(
            prompt_index=r["prompt_index"], sample_index=r["sample_index"],
            token_ids=piece("token_ids").tolist(),
            logprobs=piece("logprobs").double().tolist(),
            finish_reason=self.vocab["finish_reason"][r["finish_reason"]],
            text=piece("text").numpy().tobytes().decode(),
            correct=None if r["correct"] < 0 else bool(r["correct"]), version=r["version"],
            token_versions=piece("token_versions").tolist() if r["token_versions"] else None,
            routes=routes,
            loss_mask=piece("loss_mask").tolist() if r["loss_mask"] else None,
            turns=r["turns"], tool_calls=r["tool_calls"], tool_errors=r["tool_errors"],
            tool_seconds=tool_s,
            turn_rewards=piece("turn_rewards").tolist() if r["turn_rewards"] >= 0 else None,
            env_reward=env_r, truncation=self.vocab["truncation"][r["truncation"]],
            env_retries=r["env_retries"], dropped=self.vocab["dropped"][r["dropped"]])


def int_column(comps: Sequence[Completion], name: str) -> torch.Tensor:
    """[n] int64 an int field of every completion (`version`, `prompt_index`, ...), read from
    the columns without making a `Completion` when `comps` is a `SampleColumns`."""
    if isinstance(comps, SampleColumns):
        return comps.column(name)
    return torch.tensor([getattr(c, name) for c in comps], dtype=torch.int64)


# ---------------------------------------------------------------------- helpers
_UNMAPPED = -(2 ** 62)


def _looked_up(t: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """lut[t], refusing a value with no mapping (outside the table, or `_UNMAPPED` there)."""
    if t.numel() and not (-1 <= int(t.min()) and int(t.max()) < lut.numel() - 1):
        bad = t[(t < -1) | (t >= lut.numel() - 1)].unique().tolist()
        raise KeyError(f"versions {bad} have no mapping")
    out = lut[t]
    if bool((out == _UNMAPPED).any()):
        raise KeyError(f"versions {t[out == _UNMAPPED].unique().tolist()} have no mapping")
    return out


def _check(comps: Sequence[Completion]) -> None:
    """Refuses completions whose per-token fields disagree with their token ids (the columns
    would misalign every later row)."""
    for k, c in enumerate(comps):
        n = len(c.token_ids)
        for name in ("logprobs", "loss_mask", "token_versions"):
            got = getattr(c, name)
            if got is not None and len(got) != n:
                what = "log-probs" if name == "logprobs" else f"{name} entries"
                raise ValueError(f"completion {k} (prompt {c.prompt_index}, sample "
                                 f"{c.sample_index}) has {n} token ids and {len(got)} {what}")


def _flat(code: str, lists, dtype: torch.dtype) -> torch.Tensor:
    """The lists concatenated as one tensor, through an `array` of type `code` (filled in C:
    building a Python list of every token first took most of a 10k-sample pack)."""
    flat = array.array(code, itertools.chain.from_iterable(lists))
    return torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)


def _exact_float32(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.to(torch.float32).to(torch.float64), values))


def _default_dtype(name: str, like: list[torch.Tensor]) -> torch.dtype:
    """The dtype of a gathered flat field: float64 log-probs if any source had them."""
    dtypes = {t.dtype for t in like}
    if name == "logprobs" and torch.float64 in dtypes:
        return torch.float64
    return like[0].dtype if like else _EMPTY[name]


_EMPTY = {"token_ids": torch.int32, "logprobs": torch.float32, "token_versions": torch.int64,
          "loss_mask": torch.bool, "turn_rewards": torch.float64, "route_shapes": torch.int64,
          "routes": torch.int16, "text": torch.uint8}


def _cat(pieces: list[torch.Tensor], like: torch.Tensor | None, empty_shape: tuple,
         dtype: torch.dtype) -> torch.Tensor:
    if not pieces:
        return torch.empty(empty_shape, dtype=dtype)
    return torch.cat([p.to(dtype) for p in pieces])


def _replace(cols: SampleColumns, **changes) -> SampleColumns:
    return SampleColumns(**{**{k: getattr(cols, k) for k in
                               ("ints", "floats", *FLAT_FIELDS, "vocab")}, **changes})


__all__ = ["FLAT_FIELDS", "FLOAT_COLUMNS", "INT_COLUMNS", "SampleColumns", "int_column"]
