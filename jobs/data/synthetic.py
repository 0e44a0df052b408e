"""A deterministic, self-generated SFT task for the demo job.

Kinds:

* ``reverse`` (the demo's task): ``"rev 3917="`` -> ``"7193"``; the digit string has
  ``min_digits..max_digits`` digits (uniform), leading zeros allowed.
* ``add``: ``"12+345="`` -> ``"357"``; each operand has ``min_digits..max_digits`` digits.

Each training sequence is ``[BOS] prompt answer [EOS]``; the model reads it shifted by one and the
loss counts only the answer and EOS targets (the prompt is masked), so examples of different length
carry different numbers of target tokens, as post-training batches do.

Sharding: example ``i`` of a step's *global* batch is ``(step * world_size + rank) * batch_size + i``
and is drawn from an RNG seeded by ``(seed, that index)`` alone. Rank r's batch is therefore a
disjoint slice of the global stream, the same for any process that asks, and the concatenation of
all ranks' batches at a step equals ``make_batch(seed, step, 0, 1, world_size * batch_size)``.

Held-out split: a prompt with at least ``HOLDOUT_MIN_DIGITS`` digit characters belongs to the
evaluation set iff ``crc32(prompt) % HOLDOUT_MODULUS == 0``; training never draws those, evaluation
draws only those. Shorter prompts (too few to split: ``rev 7=`` has 10 variants) appear in both.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from shardline.jobs.data.batch import IGNORE, Batch, collate

__all__ = [
    "CharTokenizer", "TOKENIZER", "PAD", "BOS", "EOS", "TASK_KINDS", "SFTTask", "DEFAULT_TASK",
    "Batch", "encode_example", "train_examples", "make_batch", "masked_lm_loss", "generate", "generate_batch",
    "eval_examples", "evaluate", "sample_answers", "sample_prompts", "format_samples",
]


class CharTokenizer:
    """Character tokenizer: ids 0/1/2 are PAD/BOS/EOS, then one id per character of ``CHARS``."""

    PAD = 0
    BOS = 1
    EOS = 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=>?:, abcdefghijklmnopqrstuvwxyz"

    def __init__(self) -> None:
        self._stoi = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self._itos = list(self.SPECIALS) + list(self.CHARS)

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer's alphabet") from None
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS and stop_at_eos:
                break
            if i < len(self.SPECIALS):
                continue
            out.append(self._itos[i])
        return "".join(out)


TOKENIZER = CharTokenizer()
PAD, BOS, EOS = CharTokenizer.PAD, CharTokenizer.BOS, CharTokenizer.EOS

TASK_KINDS = ("reverse", "add")
HOLDOUT_MIN_DIGITS = 4
HOLDOUT_MODULUS = 8
MAX_DIGITS_LIMIT = 64


def _n_digits(prompt: str) -> int:
    return sum(c.isdigit() for c in prompt)


def is_heldout(prompt: str) -> bool:
    return _n_digits(prompt) >= HOLDOUT_MIN_DIGITS and zlib.crc32(prompt.encode()) % HOLDOUT_MODULUS == 0


@dataclass(frozen=True)
class SFTTask:
    """What to generate. ``seed`` is the data seed (the job file's ``task.seed``)."""

    kind: str = "reverse"
    min_digits: int = 1
    max_digits: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task kind must be one of {TASK_KINDS}, got {self.kind!r}")
        if not 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS_LIMIT:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits <= {MAX_DIGITS_LIMIT}, "
                f"got {self.min_digits!r}..{self.max_digits!r}"
            )

    # -- examples ---------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> tuple[str, str]:
        if self.kind == "reverse":
            n = rng.randint(self.min_digits, self.max_digits)
            s = "".join(rng.choice("0123456789") for _ in range(n))
            return f"rev {s}=", s[::-1]
        da = rng.randint(self.min_digits, self.max_digits)
        db = rng.randint(self.min_digits, self.max_digits)
        a = rng.randint(10 ** (da - 1) if da > 1 else 0, 10**da - 1)
        b = rng.randint(10 ** (db - 1) if db > 1 else 0, 10**db - 1)
        return f"{a}+{b}=", str(a + b)

    def train_example(self, index: int) -> tuple[str, str]:
        """Global training example ``index``: (prompt, answer), never a held-out prompt."""
        rng = random.Random(f"shardline-sft/{self.kind}/{self.seed}/train/{index}")
        while True:
            prompt, answer = self._draw(rng)
            if not is_heldout(prompt):
                return prompt, answer

    def eval_example(self, index: int, seed: int) -> tuple[str, str]:
        """Evaluation example ``index`` of eval stream ``seed``: a held-out prompt when its length
        allows one (see the module docstring), with the training length distribution."""
        rng = random.Random(f"shardline-sft/{self.kind}/{seed}/eval/{index}")
        prompt, answer = self._draw(rng)
        if _n_digits(prompt) < HOLDOUT_MIN_DIGITS:
            return prompt, answer
        # Redraw with the same digit counts until the prompt is held out (1 in HOLDOUT_MODULUS).
        while not is_heldout(prompt):
            prompt, answer = self._redraw_same_shape(prompt, rng)
        return prompt, answer

    def _redraw_same_shape(self, prompt: str, rng: random.Random) -> tuple[str, str]:
        if self.kind == "reverse":
            n = _n_digits(prompt)
            s = "".join(rng.choice("0123456789") for _ in range(n))
            return f"rev {s}=", s[::-1]
        da, db = (len(x) for x in prompt[:-1].split("+"))
        a = rng.randint(10 ** (da - 1) if da > 1 else 0, 10**da - 1)
        b = rng.randint(10 ** (db - 1) if db > 1 else 0, 10**db - 1)
        return f"{a}+{b}=", str(a + b)

    def solve(self, prompt: str) -> str | None:
        """The correct answer to ``prompt``, or None if it is not a prompt of this kind."""
        if self.kind == "reverse":
            if prompt.startswith("rev ") and prompt.endswith("=") and prompt[4:-1].isdigit():
                return prompt[4:-1][::-1]
            return None
        body = prompt[:-1] if prompt.endswith("=") else ""
        parts = body.split("+")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return str(int(parts[0]) + int(parts[1]))
        return None

    # -- sizes ------------------------------------------------------------------------------------
    def max_prompt_len(self) -> int:
        d = self.max_digits
        return 4 + d + 1 if self.kind == "reverse" else 2 * d + 2

    def max_answer_len(self) -> int:
        return self.max_digits if self.kind == "reverse" else self.max_digits + 1

    def max_seq_len(self) -> int:
        """Longest model input: BOS + prompt + answer (the EOS is only ever a target)."""
        return 1 + self.max_prompt_len() + self.max_answer_len()


DEFAULT_TASK = SFTTask()


def encode_example(prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``([BOS] prompt answer [EOS], labels)``: the loss counts the answer and EOS."""
    p = TOKENIZER.encode(prompt, bos=True)
    a = TOKENIZER.encode(answer, eos=True)
    return p + a, [IGNORE] * len(p) + a


def train_examples(task: SFTTask, start: int, count: int) -> list[tuple[list[int], list[int]]]:
    """Global training examples ``start .. start + count - 1``, encoded (``encode_example``)."""
    return [encode_example(*task.train_example(start + i)) for i in range(count)]


def make_batch(seed: int, step: int, rank: int, world_size: int, batch_size: int,
               task: SFTTask | None = None) -> Batch:
    """Rank ``rank``'s training batch for ``step``: deterministic in (task, seed, step, rank,
    world_size, batch_size); ranks get disjoint slices of the step's global batch.
    ``seed`` overrides ``task.seed``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if batch_size < 1 or step < 0:
        raise ValueError(f"need batch_size >= 1 and step >= 0, got {batch_size!r}, {step!r}")
    task = SFTTask(task.kind, task.min_digits, task.max_digits, seed) if task else SFTTask(seed=seed)
    return collate(train_examples(task, (step * world_size + rank) * batch_size, batch_size), pad_id=PAD)


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the masked (answer) target tokens."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    mask = loss_mask.reshape(-1).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


# -- decoding and evaluation ----------------------------------------------------------------------

@torch.no_grad()
def generate_batch(model: torch.nn.Module, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy answers to ``prompts`` (stopping at EOS). Prompts of equal length decode together."""
    was_training = model.training
    model.eval()
    try:
        out: list[str] = [""] * len(prompts)
        by_len: dict[int, list[int]] = {}
        encoded = [TOKENIZER.encode(p, bos=True) for p in prompts]
        for i, ids in enumerate(encoded):
            by_len.setdefault(len(ids), []).append(i)
        limit = getattr(model, "max_seq_len", None)
        for length, idxs in by_len.items():
            x = torch.tensor([encoded[i] for i in idxs], dtype=torch.long)
            steps = max_new_tokens if limit is None else min(max_new_tokens, limit - length + 1)
            done = torch.zeros(len(idxs), dtype=torch.bool)
            new = []
            for k in range(max(steps, 0)):
                nxt = model(x)[:, -1, :].argmax(dim=-1)
                nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
                new.append(nxt)
                done |= nxt == EOS
                if bool(done.all()) or k == steps - 1:
                    break
                x = torch.cat([x, nxt[:, None]], dim=1)
            if new:
                gen = torch.stack(new, dim=1).tolist()
                for j, i in enumerate(idxs):
                    out[i] = TOKENIZER.decode(gen[j])
        return out
    finally:
        model.train(was_training)


def generate(model: torch.nn.Module, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer to one prompt (the decoded tokens up to EOS)."""
    return generate_batch(model, [prompt], max_new_tokens)[0]


def eval_examples(task: SFTTask, n: int, seed: int) -> list[tuple[str, str]]:
    return [task.eval_example(i, seed) for i in range(n)]


def evaluate(model: torch.nn.Module, n: int, seed: int, task: SFTTask | None = None) -> float:
    """Exact-match accuracy of greedy answers on ``n`` held-out examples of eval stream ``seed``."""
    task = task or DEFAULT_TASK
    if n <= 0:
        return 0.0
    examples = eval_examples(task, n, seed)
    got = generate_batch(model, [p for p, _ in examples], task.max_answer_len() + 1)
    return sum(g == a for g, (_, a) in zip(got, examples)) / n


def sample_prompts(task: SFTTask, k: int, seed: int = 0) -> list[str]:
    """``k`` held-out prompts whose lengths spread over min..max digits, for before/after display."""
    lo, hi = task.min_digits, task.max_digits
    out = []
    for j in range(k):
        d = lo + round(j * (hi - lo) / max(k - 1, 1))
        t = SFTTask(task.kind, d, d, task.seed)
        out.append(t.eval_example(j, seed)[0])
    return out


def sample_answers(model: torch.nn.Module, prompts: Sequence[str], task: SFTTask | None = None,
                   max_new_tokens: int | None = None) -> list[dict]:
    """Greedy answers for display: ``[{"prompt", "expected", "got", "correct"}, ...]``."""
    task = task or DEFAULT_TASK
    got = generate_batch(model, list(prompts), max_new_tokens or task.max_answer_len() + 1)
    rows = []
    for p, g in zip(prompts, got):
        exp = task.solve(p)
        rows.append({"prompt": p, "expected": exp, "got": g, "correct": exp is not None and g == exp})
    return rows


def format_samples(before: Sequence[dict] | None, after: Sequence[dict] | None) -> str:
    """A text table of greedy answers before and after training (either side may be None)::

        sample answers, before  ->  after training (ok = exact match):
        prompt     expected  before          after
        rev 2=     2         ========= x  -> 2 ok
        rev 4105=  5014      ========= x  -> 5014 ok
    """
    sides = [(name, rows) for name, rows in (("before", before), ("after", after)) if rows]
    if not sides:
        return ""
    base = sides[-1][1]
    cell = lambda r: f"{r['got'] or '(empty)'} {'ok' if r['correct'] else 'x'}"  # noqa: E731
    arrow = len(sides) == 2
    table = [["prompt", "expected"] + [name if i == 0 or not arrow else "   " + name
                                       for i, (name, _) in enumerate(sides)]]
    for i, r in enumerate(base):
        cells = [cell(rows[i]) for _, rows in sides]
        if arrow:
            cells[1] = "-> " + cells[1]
        table.append([r["prompt"], r["expected"] or "?"] + cells)
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    title = "sample answers, " + ("before  ->  after training" if arrow else f"{sides[0][0]} training")
    lines = [title + " (ok = exact match):"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)
