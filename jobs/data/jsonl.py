"""SFT data from a JSONL file, tokenized with a Hugging Face tokenizer.

Formats (one JSON object per line; blank lines are skipped):

* ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``. The sequence is the prompt
  tokenized as the tokenizer does by default (its BOS, if it adds one), then the completion's tokens
  and the tokenizer's EOS; the loss counts the completion and the EOS.
* ``messages``: ``{"messages": [{"role": "...", "content": "..."}, ...]}``, rendered with the
  tokenizer's chat template. The loss counts the assistant turns: for each assistant message, the
  text the template adds for it after the generation prompt of the conversation before it (its
  content and whatever ends the turn). A template that does not render a conversation as the
  concatenation of its turns is refused.

Labels are ``IGNORE`` on prompt tokens (and padding, see :mod:`batch`); sequences are truncated to
``max_length`` tokens; an example left without a loss token (its completion truncated away) is
dropped, and the count is logged. Every rank tokenizes the whole file, so each holds the same
examples in the same order.

Order and sharding: global example ``g`` (as for the synthetic task, example ``i`` of rank ``r`` at
``step`` is ``g = (step * world_size + r) * batch_size + i``) is example ``perm_e[g mod N]`` of
epoch ``e = g div N``, where ``perm_e`` is a shuffle of ``range(N)`` seeded by ``(seed, e)`` alone.
The ranks' batches of a step are therefore disjoint slices of one global batch, which is
``batch(step, 0, 1, world_size * batch_size)``.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from typing import Any

from shardline.jobs.data.batch import IGNORE, Batch, collate
from shardline.services.errors import ShardlineConfigError

__all__ = ["FORMATS", "JsonlSFT", "read_jsonl", "tokenize_prompt_completion", "tokenize_messages"]

FORMATS = ("prompt_completion", "messages")
log = logging.getLogger("shardline.jobs")

Example = tuple[list[int], list[int]]


def read_jsonl(path: str, fmt: str) -> list[dict[str, Any]]:
    """The file's records, each checked against ``fmt``; errors name the file and line."""
    if fmt not in FORMATS:
        raise ShardlineConfigError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    records = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read data file {path!r}: {exc.strerror}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ShardlineConfigError(f"{where}: not valid JSON: {exc.msg}") from None
            _check_record(record, fmt, where)
            records.append(record)
    if not records:
        raise ShardlineConfigError(f"{path}: no examples")
    return records


def _check_record(record: Any, fmt: str, where: str) -> None:
    if fmt == "prompt_completion":
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                or not isinstance(record.get("completion"), str):
            raise ShardlineConfigError(
                f"{where}: format prompt_completion needs {{\"prompt\": str, \"completion\": str}}, got {_short(record)}")
        return
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ShardlineConfigError(
            f"{where}: format messages needs {{\"messages\": [{{\"role\": str, \"content\": str}}, ...]}}, "
            f"got {_short(record)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ShardlineConfigError(f"{where}: no assistant message to train on, got {_short(record)}")


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tokenize_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Example:
    p = list(tokenizer(prompt)["input_ids"])
    c = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        c.append(int(tokenizer.eos_token_id))
    return p + c, [IGNORE] * len(p) + c


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def tokenize_messages(tokenizer: Any, messages: Sequence[dict], where: str = "messages") -> Example:
    """The conversation through the chat template; labels on the assistant turns' tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise ShardlineConfigError(f"{where}: data.format messages needs a tokenizer with a chat template")
    text = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ShardlineConfigError(
                f"{where}: the chat template does not render this conversation turn by turn, so the "
                f"assistant turns cannot be located")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [tok if any(lo <= start < hi for lo, hi in spans) and end > start else IGNORE
              for tok, (start, end) in zip(ids, enc["offset_mapping"])]
    return ids, labels


class JsonlSFT:
    """The tokenized examples of a JSONL file and their deterministic order (module docstring)."""

    def __init__(self, path: str, fmt: str, max_length: int, seed: int, tokenizer: Any):
        self.path, self.format, self.max_length, self.seed = path, fmt, max_length, seed
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.examples: list[Example] = []
        dropped = 0
        for n, record in enumerate(read_jsonl(path, fmt)):
            if fmt == "prompt_completion":
                ids, labels = tokenize_prompt_completion(tokenizer, record["prompt"], record["completion"])
            else:
                ids, labels = tokenize_messages(tokenizer, record["messages"], where=f"{path}: example {n}")
            ids, labels = ids[:max_length], labels[:max_length]
            if len(ids) < 2 or all(x == IGNORE for x in labels[1:]):
                dropped += 1
                continue
            self.examples.append((ids, labels))
        if not self.examples:
            raise ShardlineConfigError(
                f"{path}: no example keeps a completion token within data.max_length {max_length}")
        if dropped:
            log.warning("%s: %d example(s) dropped: no completion token within data.max_length %d",
                        path, dropped, max_length)
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def index(self, g: int) -> int:
        """Which example global index ``g`` is."""
        epoch, pos = divmod(g, len(self.examples))
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(len(self.examples)))
            random.Random(f"shardline-jsonl/{self.seed}/{epoch}").shuffle(perm)
            if len(self._perms) >= 2:  # the stream moves forward: keep this epoch and the last
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm[pos]

    def examples_at(self, start: int, count: int) -> list[Example]:
        """Global examples ``start .. start + count - 1`` of the stream, as ``(ids, labels)``."""
        return [self.examples[self.index(start + i)] for i in range(count)]

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Batch:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        return collate(self.examples_at((step * world_size + rank) * batch_size, batch_size), pad_id=self.pad_id)
