"""Which units each stage trains: base prefix depth p, global-head size r, segmentation of the body.

Notation (SegProp §3.3): the model is h . f_{n-1} . ... . f_0 over n *units* (blocks of the block
view, or a finer view, see views.py). The global head LL^(r) is the last r units plus the task head;
the other n - r units form the *body*, cut into contiguous segments. The first segment is the base
prefix f^[0:p] (the embedding always goes with it): stage 0 trains it jointly with LL^(r) through an
adapter; stage i >= 1 trains segment i with everything before it frozen. Counting as the paper's
Tables 1-2 do, `segments=N` is the number of body segments including the prefix, so N stages.

Three ways to say how the body is cut (exactly one, or none for the default of 2 equal segments):
  segments=N   N segments as equal as possible, the remainder going to the earliest (the paper's
               LLaMA-70B split of 76 layers into 26/25/25); with balance="memory" (trainer option)
               N segments of balanced activation memory instead (balanced_split)
  split=[...]  explicit sizes, the first is p (0 = the embedding alone), the rest >= 1
  prefix=p     a prefix of p units, then one unit per stage (Algorithm 1 as written)

Layer-wise training (`lw`) uses the same options but has no persistent head: the r head units are
appended to the last segment, each segment trains with its own auxiliary classifier, and a final
stage trains the task head alone on the frozen backbone (paper §4.1.2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from edgetrain.registry import EdgetrainError


@dataclass(frozen=True)
class Stage:
    """One stage of a schedule over n units.

    Trains the units [start, end) (and the embedding when `trains_embed`), the stage's bridge
    (an adapter or an auxiliary classifier, when `bridge`), the head units [tail_start, n) and the
    task head when `trains_head`. Everything before `start` is committed: frozen, in eval(), run
    without autograd (`frozen_depth` = start units after the embedding; None when the embedding
    itself trains, so there is no frozen prefix).
    """

    index: int
    start: int
    end: int
    trains_embed: bool
    bridge: bool          # an adapter (segprop) or auxiliary classifier (lw) follows unit end-1
    tail_start: int       # head units [tail_start, n) run (and train) after the bridge
    trains_head: bool     # the model's own head is on the loss path and trains
    num_units: int

    @property
    def frozen_depth(self) -> int | None:
        return None if self.trains_embed else self.start

    @property
    def name(self) -> str:
        if self.start == self.end and not self.trains_embed:
            return "head"
        units = f"units {self.start}..{self.end - 1}" if self.end > self.start else "no units"
        return f"embed + {units}" if self.trains_embed else units


@dataclass(frozen=True)
class StagePlan:
    kind: str                  # "segprop" or "lw"
    num_units: int
    head_blocks: int           # r (segprop); for lw the head units were folded into the last segment
    split: tuple[int, ...]     # body segment sizes, split[0] = p
    stages: tuple[Stage, ...]

    @property
    def prefix(self) -> int:
        return self.split[0]

    @property
    def head_start(self) -> int:
        return self.num_units - self.head_blocks

    def describe(self) -> str:
        lines = [f"{self.kind}: {self.num_units} units, body split {list(self.split)}"
                 + (f", global head = units {self.head_start}..{self.num_units - 1} + head"
                    if self.kind == "segprop" else "")]
        for stage in self.stages:
            parts = [stage.name]
            if stage.bridge:
                parts.append("adapter" if self.kind == "segprop" else "auxiliary classifier")
            if stage.tail_start < stage.num_units:
                parts.append(f"head units {stage.tail_start}..{stage.num_units - 1}")
            if stage.trains_head:
                parts.append("head")
            frozen = "nothing" if stage.frozen_depth is None else f"embed + {stage.frozen_depth} units"
            lines.append(f"  stage {stage.index}: trains {' + '.join(parts)}; frozen: {frozen}")
        return "\n".join(lines)


def even_split(total: int, parts: int) -> list[int]:
    """`total` units in `parts` contiguous groups as equal as possible, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_split(costs: Sequence[float], embed_cost: float, parts: int,
                   extras: Sequence[float] | None = None, embed_extra: float = 0.0) -> list[int]:
    """Cut units with these costs into `parts` contiguous segments (the first may be empty: the
    embedding alone) so that the largest segment cost is as small as possible. A segment costs the
    sum of its units' `costs` plus the largest of their `extras` (the first segment's includes the
    embedding's). Used with activation bytes (saved for backward; largest backward transient): the
    stage that holds the most sets a schedule's peak memory."""
    count = len(costs)
    if not 1 <= parts <= count + 1:
        raise EdgetrainError(f"cannot cut {count} units into {parts} segments")
    extras = [0.0] * count if extras is None else list(extras)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def segment(i: int, j: int) -> float:
        return prefix[j] - prefix[i] + max(extras[i:j], default=0.0)

    inf = float("inf")
    # best[k][j]: minimal largest cost of cutting units [0, j) into k segments; first one may be empty.
    best = [[inf] * (count + 1) for _ in range(parts + 1)]
    cut = [[0] * (count + 1) for _ in range(parts + 1)]
    for j in range(count + 1):
        best[1][j] = embed_cost + prefix[j] + max([embed_extra, *extras[:j]])
    for k in range(2, parts + 1):
        for j in range(k - 1, count + 1):
            for i in range(k - 2, j):   # the last segment is [i, j), at least one unit
                value = max(best[k - 1][i], segment(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    sizes, j = [], count
    for k in range(parts, 1, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def body_split(body: int, *, segments: int | None = None, split: Sequence[int] | None = None,
               prefix: int | None = None, what: str = "segprop") -> list[int]:
    given = [name for name, value in (("segments", segments), ("split", split), ("prefix", prefix))
             if value is not None]
    if len(given) > 1:
        raise EdgetrainError(f"{what}: give one of segments, split or prefix, not {' and '.join(given)}")
    if split is not None:
        sizes = [int(s) for s in split]
        if not sizes or sizes[0] < 0 or any(s < 1 for s in sizes[1:]) or sum(sizes) != body:
            raise EdgetrainError(f"{what}: split {list(split)} must be sizes summing to the {body} body units "
                                 "(the first, the base prefix, may be 0; the others at least 1)")
        return sizes
    if prefix is not None:
        if not 0 <= prefix <= body:
            raise EdgetrainError(f"{what}: prefix = {prefix} must be in 0..{body} (the body has {body} units)")
        return [prefix] + [1] * (body - prefix)
    segments = 2 if segments is None else int(segments)
    if not 1 <= segments <= body:
        raise EdgetrainError(f"{what}: segments = {segments} must be in 1..{body} (the body has {body} units)")
    return even_split(body, segments)


def check_head_blocks(num_units: int, head_blocks: int, what: str) -> None:
    if not (isinstance(head_blocks, int) and 0 <= head_blocks < num_units):
        raise EdgetrainError(f"{what}: head_blocks = {head_blocks!r} must be in 0..{num_units - 1} "
                             f"(the model has {num_units} units and the body needs at least one)")


def plan_segprop(num_units: int, *, head_blocks: int = 1, segments: int | None = None,
                 split: Sequence[int] | None = None, prefix: int | None = None,
                 costs: Sequence[tuple[float, float]] | None = None) -> StagePlan:
    """`costs` = (saved bytes, largest activation) of the embedding, unit 0, unit 1, ... cuts
    `segments` by balanced memory instead of by equal unit counts (balanced_split)."""
    check_head_blocks(num_units, head_blocks, "segprop")
    head_start = num_units - head_blocks
    if costs is not None and split is None and prefix is None:
        saved, extra = [c[0] for c in costs], [2 * c[1] for c in costs]
        split = balanced_split(saved[1:head_start + 1], saved[0], 2 if segments is None else segments,
                               extra[1:head_start + 1], extra[0])
        segments = None
    sizes = body_split(head_start, segments=segments, split=split, prefix=prefix)
    stages, start = [], 0
    for index, size in enumerate(sizes):
        end = start + size
        stages.append(Stage(index=index, start=start, end=end, trains_embed=index == 0,
                            bridge=end != head_start, tail_start=head_start, trains_head=True,
                            num_units=num_units))
        start = end
    return StagePlan("segprop", num_units, head_blocks, tuple(sizes), tuple(stages))


def plan_lw(num_units: int, *, head_blocks: int = 0, segments: int | None = None,
            split: Sequence[int] | None = None, prefix: int | None = None,
            costs: Sequence[tuple[float, float]] | None = None) -> StagePlan:
    """Segments over the body as for segprop (the r head units join the last one), an auxiliary
    classifier per segment, then a head-only stage."""
    check_head_blocks(num_units, head_blocks, "lw")
    body = num_units - head_blocks
    if costs is not None and split is None and prefix is None:
        saved, extra = [c[0] for c in costs], [2 * c[1] for c in costs]
        split = balanced_split(saved[2:body + 1], saved[0] + saved[1], 2 if segments is None else segments,
                               extra[2:body + 1], max(extra[0], extra[1]))
        split[0] += 1   # the first lw segment holds at least one unit
        segments = None
    sizes = body_split(body, segments=segments, split=split, prefix=prefix, what="lw")
    sizes[-1] += head_blocks
    if sizes[0] == 0:
        raise EdgetrainError("lw: the first segment needs at least one unit (an embedding alone has no "
                             "auxiliary classifier worth training)")
    stages, start = [], 0
    for index, size in enumerate(sizes):
        end = start + size
        stages.append(Stage(index=index, start=start, end=end, trains_embed=index == 0, bridge=True,
                            tail_start=num_units, trains_head=False, num_units=num_units))
        start = end
    stages.append(Stage(index=len(sizes), start=num_units, end=num_units, trains_embed=False, bridge=False,
                        tail_start=num_units, trains_head=True, num_units=num_units))
    return StagePlan("lw", num_units, 0, tuple(sizes), tuple(stages))


def plan_stages(name: str, num_units: int, *, head_blocks: int | None = None, segments: int | None = None,
                split: Sequence[int] | None = None, prefix: int | None = None,
                costs: Sequence[tuple[float, float]] | None = None) -> StagePlan:
    """The plan of staged method `name` ("segprop" or "lw"); head_blocks None = its default (1 or 0)."""
    if name == "segprop":
        return plan_segprop(num_units, head_blocks=1 if head_blocks is None else head_blocks,
                            segments=segments, split=split, prefix=prefix, costs=costs)
    if name == "lw":
        return plan_lw(num_units, head_blocks=0 if head_blocks is None else head_blocks,
                       segments=segments, split=split, prefix=prefix, costs=costs)
    raise EdgetrainError(f"unknown staged method {name!r}")
