"""Length-aware balancing of a global minibatch across ranks, so no rank under BSP waits for one
given several times its compute.

Contract: pure functions (numpy for the least-squares fit): no torch, no network, no state.
``balanced_split(lengths, world_size, cost)`` is deterministic, so every rank reading the same
global minibatch computes the same split without communicating and takes ``[rank]``; pushing with
``rank_weights`` makes the PS's weighted mean the gradient of the token-mean loss of the whole
minibatch (the split changes who computes what, never the parameters). A sequence of length ``L``
costs ``c0 + c1*L + c2*L**2`` (``CostModel``).

Design: docs/architecture.md, "Length-balanced minibatches".
"""

from __future__ import annotations

import heapq
import math
import operator
import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence, Union

import numpy as np

from shardline.services.errors import ShardlineConfigError

METHODS = ("kk", "lpt", "contiguous")
# Lengths CostModel.measure times by default: the range of an SFT minibatch (16..512 tokens).
DEFAULT_MEASURE_LENGTHS = (16, 32, 64, 96, 128, 192, 256, 384, 512)

Cost = Union[None, "CostModel", Callable[[int], float]]


# --------------------------------------------------------------------------------------------
# cost model
# --------------------------------------------------------------------------------------------
def _coefficient(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ShardlineConfigError(f"CostModel {name} must be a finite number >= 0, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ShardlineConfigError(f"CostModel {name} must be a finite number >= 0, got {value!r}")
    return v


@dataclass(frozen=True)
class CostModel:
    """The compute cost of one sequence of length ``L``: ``c0 + c1*L + c2*L**2`` (any unit, e.g.
    seconds; only ratios matter for balancing). Coefficients are finite and >= 0, and at least
    one is > 0; a bad value raises ``ShardlineConfigError`` quoting it.

    ``CostModel(0, 1, 0)`` (``CostModel.tokens()``) is the token count, the default of
    ``balanced_split``. A ``CostModel`` is callable: ``model(L) == model.cost(L)``.
    """

    c0: float = 0.0
    c1: float = 1.0
    c2: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0", "c1", "c2"):
            object.__setattr__(self, name, _coefficient(name, getattr(self, name)))
        if self.c0 == self.c1 == self.c2 == 0.0:
            raise ShardlineConfigError(
                f"CostModel needs a coefficient > 0, got c0={self.c0!r}, c1={self.c1!r}, c2={self.c2!r}")

    @classmethod
    def tokens(cls) -> "CostModel":
        """Cost = number of tokens (``c1 = 1``)."""
        return cls(0.0, 1.0, 0.0)

    def cost(self, length: int) -> float:
        """``c0 + c1*length + c2*length**2`` for one sequence (``length`` an integer >= 0)."""
        L = _length(length, "length")
        return self.c0 + self.c1 * L + self.c2 * L * L

    __call__ = cost

    def as_dict(self) -> dict[str, float]:
        """``{"c0": ..., "c1": ..., "c2": ...}``, the form ``from_config`` reads (job files, logs)."""
        return {"c0": self.c0, "c1": self.c1, "c2": self.c2}

    @classmethod
    def from_config(cls, value) -> "CostModel":
        """A cost model given in a configuration: a mapping ``{c0: .., c1: .., c2: ..}`` (missing
        keys are 0) or a sequence ``[c0, c1, c2]``. Anything else, or an unknown key, raises
        ``ShardlineConfigError`` quoting it."""
        if isinstance(value, dict):
            unknown = sorted(str(k) for k in value if k not in ("c0", "c1", "c2"))
            if unknown:
                raise ShardlineConfigError(f"cost model: unknown key(s) {unknown!r} (known: c0, c1, c2), got {value!r}")
            return cls(value.get("c0", 0.0), value.get("c1", 0.0), value.get("c2", 0.0))
        if isinstance(value, (list, tuple)) and len(value) == 3:
            return cls(*value)
        raise ShardlineConfigError(f"cost model must be a mapping {{c0, c1, c2}} or a list [c0, c1, c2], got {value!r}")

    @classmethod
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> "CostModel":
        """Least-squares fit of ``seconds[i] ~ c0 + c1*lengths[i] + c2*lengths[i]**2`` with all
        coefficients >= 0 (non-negative least squares: the best of the unconstrained fits on every
        subset of the three terms whose coefficients are all >= 0).

        Needs at least 3 distinct lengths and finite timings >= 0, not all 0. Raises
        ``ShardlineConfigError`` quoting a bad value.
        """
        Ls = _lengths(lengths)
        ys = list(seconds)
        if len(ys) != len(Ls):
            raise ShardlineConfigError(f"CostModel.fit: {len(Ls)} lengths but {len(ys)} timings")
        for i, y in enumerate(ys):
            if isinstance(y, bool) or not isinstance(y, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(y)) or float(y) < 0:
                raise ShardlineConfigError(f"CostModel.fit: seconds[{i}] must be a finite number >= 0, got {y!r}")
        if len(set(Ls)) < 3:
            raise ShardlineConfigError(f"CostModel.fit needs at least 3 distinct lengths, got {sorted(set(Ls))!r}")
        y = np.asarray(ys, dtype=np.float64)
        if not np.any(y > 0):
            raise ShardlineConfigError("CostModel.fit: every timing is 0; nothing to fit")
        scale = float(max(Ls))  # columns 1, x, x**2 with x = L / max(L) in [0, 1]: well conditioned
        x = np.asarray(Ls, dtype=np.float64) / scale
        design = np.stack([np.ones_like(x), x, x * x], axis=1)
        best: tuple[float, np.ndarray] | None = None
        for cols in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            sol, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(3)
            coef[list(cols)] = sol
            resid = float(np.sum((design @ coef - y) ** 2))
            if best is None or resid < best[0] * (1 - 1e-12):
                best = (resid, coef)
        assert best is not None  # a single column with y >= 0 always has a coefficient >= 0
        b = best[1]
        return cls(float(b[0]), float(b[1]) / scale, float(b[2]) / (scale * scale))

    @classmethod
    def measure(cls, forward_backward: Callable[[int], None], lengths: Iterable[int] = DEFAULT_MEASURE_LENGTHS, *,
                repeats: int = 3, warmup: int = 1, clock: Callable[[], float] = time.perf_counter) -> "CostModel":
        """Fit the coefficients on this machine: time ``forward_backward(L)`` (which should run one
        forward and backward pass of the model on one sequence of ``L`` tokens) for each of
        ``lengths``, after ``warmup`` untimed calls per length, ``repeats`` times (alternating the
        order of the lengths so a load that drifts hits all of them), take the fastest time per
        length (the least disturbed by other work on the machine) and ``fit`` those.

        Every rank of a job should use the same cost model (measure on one rank and share the
        coefficients, or give them in the job file): different models give different splits.
        """
        Ls = _lengths(lengths)
        if len(set(Ls)) < 3:
            raise ShardlineConfigError(f"CostModel.measure needs at least 3 distinct lengths, got {Ls!r}")
        repeats = _int_at_least(repeats, 1, "repeats")
        warmup = _int_at_least(warmup, 0, "warmup")
        if not callable(forward_backward):
            raise ShardlineConfigError(f"CostModel.measure: forward_backward must be callable, got {forward_backward!r}")
        for L in Ls:
            for _ in range(warmup):
                forward_backward(L)
        best = [math.inf] * len(Ls)
        for r in range(repeats):
            order = range(len(Ls)) if r % 2 == 0 else range(len(Ls) - 1, -1, -1)
            for pos in order:
                start = clock()
                forward_backward(Ls[pos])
                best[pos] = min(best[pos], clock() - start)
        return cls.fit(Ls, [max(t, 0.0) for t in best])


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------
def _length(value, what: str) -> int:
    if isinstance(value, bool):
        raise ShardlineConfigError(f"{what} must be an integer >= 0, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ShardlineConfigError(f"{what} must be an integer >= 0, got {value!r}") from None
    if v < 0:
        raise ShardlineConfigError(f"{what} must be an integer >= 0, got {value!r}")
    return v


def _lengths(lengths: Iterable[int], what: str = "lengths") -> list[int]:
    if isinstance(lengths, (str, bytes)):
        raise ShardlineConfigError(f"{what} must be a sequence of integers >= 0, got {lengths!r}")
    try:
        items = list(lengths)
    except TypeError:
        raise ShardlineConfigError(f"{what} must be a sequence of integers >= 0, got {lengths!r}") from None
    return [_length(v, f"{what}[{i}]") for i, v in enumerate(items)]


def _int_at_least(value, lo: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ShardlineConfigError(f"{what} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _costs(lengths: list[int], cost: Cost) -> list[float]:
    if cost is None:
        return [float(L) for L in lengths]
    if not callable(cost):
        raise ShardlineConfigError(f"cost must be None, a CostModel or a callable length -> cost, got {cost!r}")
    out = []
    for i, L in enumerate(lengths):
        c = cost(L)
        try:
            v = float(c)
        except (TypeError, ValueError):
            v = math.nan
        if isinstance(c, bool) or not math.isfinite(v) or v < 0:
            raise ShardlineConfigError(f"cost({L}) (lengths[{i}]) must be a finite number >= 0, got {c!r}")
        out.append(v)
    return out


def _check_indices(indices: Iterable[int], n: int, what: str) -> list[int]:
    out = [_length(v, f"{what}[{i}]") for i, v in enumerate(indices)]
    seen: set[int] = set()
    for i, v in enumerate(out):
        if v >= n:
            raise ShardlineConfigError(f"{what}[{i}] = {v!r} is out of range for {n} sequences")
        if v in seen:
            raise ShardlineConfigError(f"{what}[{i}] = {v!r} is repeated")
        seen.add(v)
    return out


# --------------------------------------------------------------------------------------------
# splitting
# --------------------------------------------------------------------------------------------
def balanced_split(lengths: Sequence[int], world_size: int, cost: Cost = None, method: str = "kk") -> list[list[int]]:
    """Split a global minibatch of sequences with ``lengths`` over ``world_size`` ranks so that
    the per-rank sums of ``cost(length)`` are as even as the method manages.

    ``cost``: None (the token count, ``CostModel.tokens()``), a ``CostModel``, or any callable
    ``length -> cost`` (finite, >= 0). ``method``: ``"kk"`` (Karmarkar-Karp largest differencing,
    multi-way, then single moves and pairwise swaps out of the fullest rank while they lower it; the
    default, usually the most even), ``"lpt"`` (longest processing time first:
    each sequence, costliest first, to the least loaded rank; within ``4/3 - 1/(3*world_size)`` of
    the optimum, and so is KK) or ``"contiguous"`` (the naive baseline: consecutive chunks of equal
    count, the first ``n % world_size`` one longer).

    Returns ``world_size`` lists of indices into ``lengths``, one per rank (rank ``r`` takes
    ``[r]``). Contract:

    * every index appears in exactly one list; each list is ascending;
    * deterministic: equal arguments give the equal split on every rank and every machine (ties
      between equal costs are broken by index; no randomness, no hashing), so the ranks need not
      communicate; they must use the same ``cost`` and ``method``;
    * lists are ordered by their smallest index (rank 0 gets sequence 0), empty lists last;
    * with ``len(lengths) >= world_size`` every rank gets at least one sequence (also with
      zero costs);
    * with fewer sequences than ranks (or none), ranks ``len(lengths)`` and up get ``[]``. Such a
      rank still takes part in the step: under BSP the PS waits for all ``world_size`` commits. It
      runs no forward/backward and calls ``opt.step(weight=w.weight)`` with no gradient (grads
      None, so nothing is pushed but the commit), with ``w`` from ``rank_weights``, which then
      gives every rank weight 1 and a loss scale that keeps the mean exact (the PS requires
      weights > 0, so a weight of 0 is not an option).

    ``world_size`` below 1, a negative or non-integer length, an unknown method or a bad cost
    raise ``ShardlineConfigError`` quoting the value.
    """
    k = _int_at_least(world_size, 1, "world_size")
    if method not in METHODS:
        raise ShardlineConfigError(f"balanced_split method must be one of {', '.join(METHODS)}; got {method!r}")
    Ls = _lengths(lengths)
    n = len(Ls)
    if method == "contiguous":
        q, r = divmod(n, k)
        bounds = [i * q + min(i, r) for i in range(k + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
    costs = _costs(Ls, cost)
    if k == 1 or n == 0:
        parts = [list(range(n))] + [[] for _ in range(k - 1)]
    elif method == "lpt":
        parts = _lpt(costs, k)
    else:
        parts = _improve_fullest(_karmarkar_karp(costs, k), costs)
    for p in parts:
        p.sort()
    parts.sort(key=lambda p: p[0] if p else n)
    return parts


def _lpt(costs: list[float], k: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, 0, r) for r in range(k)]  # (load, count, rank): a tie in load goes to the emptier rank
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, count, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + costs[i], count + 1, r))
    return parts


def _karmarkar_karp(costs: list[float], k: int) -> list[list[int]]:
    """Multi-way largest differencing: every sequence starts as a k-way partial partition (itself
    in one subset, k-1 empty). Repeatedly merge the two partials with the largest spread (max - min
    subset sum) by joining the largest subset of one with the smallest of the other, the second
    largest with the second smallest, and so on, until one partial remains."""
    n = len(costs)

    def order(subsets):
        # descending by (sum, count); then ascending by smallest index (unique among non-empty
        # subsets, so the order is total): empty subsets last, ties never depend on list identity
        subsets.sort(key=lambda s: (-s[0], -len(s[2]), s[1]))
        return subsets

    heap = []
    for i, c in enumerate(costs):
        # a subset: [sum, smallest index (n if empty), indices]
        subsets = [[c, i, [i]]] + [[0.0, n, []] for _ in range(k - 1)]
        heap.append((-c, i, subsets))  # (-(spread), smallest index of the partial, subsets)
    heapq.heapify(heap)
    while len(heap) > 1:
        _, first_a, a = heapq.heappop(heap)
        _, first_b, b = heapq.heappop(heap)
        merged = []
        for sa, sb in zip(a, reversed(b)):
            sa[2].extend(sb[2])
            merged.append([sa[0] + sb[0], min(sa[1], sb[1]), sa[2]])
        order(merged)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(first_a, first_b), merged))
    return [s[2] for s in heap[0][2]]


def _improve_fullest(parts: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Local search after KK: move one sequence out of the fullest part, or swap one of it for a
    cheaper one of another part, taking the change that leaves the two parts' larger load lowest,
    while some change lowers the fullest part (each accepted change lowers the sorted loads, so
    it ends). KK leaves 1.9 % between the fullest rank and the mean on 8 lognormal(ln 64, 1)
    lengths over 2 ranks; this takes it to 1.3 % (the optimum there: 1.0 %). Pure Python floats and
    a total order on the candidates, so every rank finds the same split. A part keeps at least
    one sequence."""
    k = len(parts)
    loads = [sum(costs[i] for i in p) for p in parts]
    for _ in range(4 * len(costs) * k):   # a bound far above what the changes take; never reached
        hi = max(range(k), key=lambda r: (loads[r], -r))
        best = min((c for c in _changes_out_of(hi, parts, loads, costs) if c[0] < loads[hi]), default=None)
        if best is None:
            break
        _, lo, i, j = best
        parts[hi].remove(i)
        parts[lo].append(i)
        if j >= 0:
            parts[lo].remove(j)
            parts[hi].append(j)
        loads[hi], loads[lo] = sum(costs[x] for x in parts[hi]), sum(costs[x] for x in parts[lo])
    return parts


def _changes_out_of(hi: int, parts: list[list[int]], loads: list[float], costs: list[float]):
    """Every move of one sequence out of part ``hi`` and every swap of one of it for a cheaper one
    of another part, as ``(the two parts' larger load after it, other part, sequence out, sequence
    in or -1)``."""
    top = loads[hi]
    for lo in range(len(parts)):
        if lo == hi:
            continue
        for i in parts[hi]:
            if len(parts[hi]) > 1:
                yield max(top - costs[i], loads[lo] + costs[i]), lo, i, -1
            for j in parts[lo]:
                if costs[i] > costs[j]:
                    d = costs[i] - costs[j]
                    yield max(top - d, loads[lo] + d), lo, i, j


def part_costs(split: Sequence[Sequence[int]], lengths: Sequence[int], cost: Cost = None) -> list[float]:
    """The cost of each rank's part: the sum of ``cost(lengths[i])`` over its indices."""
    costs = _costs(_lengths(lengths), cost)
    return [math.fsum(costs[i] for i in _check_indices(part, len(costs), f"split[{r}]")) for r, part in enumerate(split)]


def imbalance(loads: Sequence[float]) -> float:
    """``max / mean`` of per-rank loads (costs or measured seconds): 1.0 is perfectly even, and
    ``world_size`` means one rank does everything. 1.0 when every load is 0."""
    values = [float(v) for v in loads]
    if not values:
        raise ShardlineConfigError("imbalance of no ranks")
    total = math.fsum(values)
    return 1.0 if total == 0 else max(values) * len(values) / total


# --------------------------------------------------------------------------------------------
# microbatches
# --------------------------------------------------------------------------------------------
def micro_batches(indices: Sequence[int], lengths: Sequence[int], micro_batch_tokens: int, *,
                  padded: bool = False) -> list[list[int]]:
    """Pack one rank's part (``indices`` into ``lengths``) into microbatches of at most
    ``micro_batch_tokens`` tokens each, so a rank with many short sequences runs more, smaller
    microbatches than a rank with a few long ones (ranks may run different numbers; the PS only
    synchronizes the minibatch).

    Tokens of a microbatch: ``padded=False`` (packed / variable-length attention) the sum of its
    lengths, packed first-fit decreasing; ``padded=True`` (a rectangular ``[B, T]`` batch padded to
    its longest sequence) ``len(mb) * max(length)``, filled in order of decreasing length so that
    similar lengths share a microbatch. A sequence longer than ``micro_batch_tokens`` gets a
    microbatch of its own (it is never cut). Every index appears exactly once; each microbatch
    lists its indices longest first (ties by index). Deterministic. ``[]`` for an empty part.
    """
    Ls = _lengths(lengths)
    idx = _check_indices(indices, len(Ls), "indices")
    limit = _int_at_least(micro_batch_tokens, 1, "micro_batch_tokens")
    bins: list[list] = []  # [tokens, longest length, indices]
    for i in sorted(idx, key=lambda i: (-Ls[i], i)):
        L = Ls[i]
        if padded:
            if bins and (len(bins[-1][2]) + 1) * bins[-1][1] <= limit:
                bins[-1][2].append(i)
            else:
                bins.append([L, L, [i]])
            continue
        for b in bins:
            if b[0] + L <= limit:
                b[0] += L
                b[2].append(i)
                break
        else:
            bins.append([L, L, [i]])
    return [b[2] for b in bins]


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
class RankWeight(NamedTuple):
    """What one rank passes to the PS for a balanced minibatch: ``opt.step(weight=weight)`` (or
    ``client.push(..., weight=weight)``) after backpropagating ``loss_scale * S``, where ``S`` is
    the **sum** of the per-token losses over its part's loss tokens (``loss_tokens`` of them)."""

    weight: float
    loss_scale: float
    loss_tokens: int


def rank_weights(split: Sequence[Sequence[int]], loss_tokens: Sequence[int]) -> list[RankWeight]:
    """The weighting contract of a balanced minibatch, per rank of ``split``; ``loss_tokens[i]`` is
    the number of tokens of sequence ``i`` that count in the loss (e.g. the response tokens of an
    SFT example). Every rank can compute all of it, since every rank knows the whole split.

    With ``t_r`` the loss tokens of rank ``r``, ``T = sum(t_r)``, ``S_r`` the sum of the per-token
    losses of rank ``r`` and ``g_r`` the gradient it pushes, the PS applies the weighted mean of
    SPEC "Training semantics" (ps_server/store/apply.py): ``sum_r(w_r * g_r) / sum_r(w_r)``.

    * Every rank has loss tokens (the usual case): ``weight = t_r`` and ``loss_scale = 1 / t_r``,
      i.e. each rank backpropagates the token mean of its own part and pushes with its number of
      loss tokens. Then ``sum_r(t_r * grad(S_r) / t_r) / sum_r(t_r) = grad(S) / T``.
    * Some rank has none (fewer sequences than ranks, or sequences without loss tokens): the PS
      takes only weights > 0, so every rank gets ``weight = 1`` and ``loss_scale = world_size / T``.
      Then ``sum_r(world_size / T * grad(S_r)) / world_size = grad(S) / T`` again; a rank without
      loss tokens pushes no gradient (it still commits the step).
    * No loss tokens at all (``T = 0``): ``weight = 1``, ``loss_scale = 0``; the step applies a
      zero gradient.

    Either way the PS's mean is the gradient of the token-mean loss of the whole global minibatch
    (``grad(S) / T``), the gradient one process would compute on it: the split only changes who
    computes what. Raises ``ShardlineConfigError`` for a bad count or index.
    """
    tokens = _lengths(loss_tokens, "loss_tokens")
    per_rank = [sum(tokens[i] for i in _check_indices(part, len(tokens), f"split[{r}]")) for r, part in enumerate(split)]
    if not per_rank:
        raise ShardlineConfigError("rank_weights of a split with no ranks")
    total = sum(per_rank)
    if all(t > 0 for t in per_rank):
        return [RankWeight(float(t), 1.0 / t, t) for t in per_rank]
    scale = len(per_rank) / total if total else 0.0
    return [RankWeight(1.0, scale, t) for t in per_rank]


# --------------------------------------------------------------------------------------------
# the seam for training loops (the worker daemon's and users' own)
# --------------------------------------------------------------------------------------------
class RankPlan(NamedTuple):
    """One rank's share of a balanced global minibatch (``plan_rank``)."""

    indices: list[int]              # its sequences (indices into the global minibatch), ascending
    micro_batches: list[list[int]]  # the same indices, grouped into microbatches to run in turn
    weight: float                   # opt.step(weight=...)
    loss_scale: float               # backpropagate loss_scale * (sum of per-token losses)
    loss_tokens: int                # the loss tokens of its part


def plan_rank(lengths: Sequence[int], world_size: int, rank: int, *, loss_tokens: Sequence[int] | None = None,
              cost: Cost = None, method: str = "kk", micro_batch_tokens: int | None = None,
              padded: bool = False) -> RankPlan:
    """``balanced_split`` + ``micro_batches`` + ``rank_weights`` for one rank of one global
    minibatch: what a training loop (``train: {balance: tokens, micro_batch_tokens: N}``) needs
    per step. ``loss_tokens`` defaults to ``lengths`` (every token counts in the loss);
    ``micro_batch_tokens=None`` runs the whole part as one microbatch."""
    k = _int_at_least(world_size, 1, "world_size")
    r = _int_at_least(rank, 0, "rank")
    if r >= k:
        raise ShardlineConfigError(f"rank must be < world_size ({k}), got {rank!r}")
    if loss_tokens is not None and len(loss_tokens) != len(lengths):
        raise ShardlineConfigError(f"plan_rank: {len(lengths)} lengths but {len(loss_tokens)} loss_tokens")
    split = balanced_split(lengths, k, cost=cost, method=method)
    w = rank_weights(split, lengths if loss_tokens is None else loss_tokens)[r]
    mine = split[r]
    if micro_batch_tokens is None:
        mbs = [list(mine)] if mine else []
    else:
        mbs = micro_batches(mine, lengths, micro_batch_tokens, padded=padded)
    return RankPlan(mine, mbs, w.weight, w.loss_scale, w.loss_tokens)
