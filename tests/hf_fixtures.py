"""A tiny random Llama and a small word-level tokenizer, built locally (nothing is downloaded), and
JSONL files of a small lookup task for Hugging Face job tests.

    model_dir = build_tiny_llama(tmp_path / "llama")        # save_pretrained: model + tokenizer
    write_jsonl(tmp_path / "train.jsonl", prompt_completion_records())

The task: ``"color of apple ?"`` -> ``"red"``, twelve facts, so a 2-layer model learns it in a few
dozen steps. The tokenizer splits on whitespace (one token per word), pads with ``<pad>``, ends
with ``</s>``, and has a chat template ``<|role|> content`` with ``</s>`` after assistant turns.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

FACTS = {
    "apple": "red", "banana": "yellow", "grass": "green", "sky": "blue", "snow": "white", "coal": "black",
    "orange": "orange", "plum": "purple", "rose": "pink", "sand": "beige", "ash": "grey", "gold": "golden",
}
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}"
    "{% if m['role'] == 'assistant' %}{{ '</s> ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
EXTRA_WORDS = "color of ? what is the answer please tell me you are a helpful model".split()


def vocabulary() -> list[str]:
    words = dict.fromkeys(EXTRA_WORDS + [w for kv in FACTS.items() for w in kv])
    return list(words)


def build_tokenizer(words: Iterable[str] | None = None):
    """A PreTrainedTokenizerFast over ``words`` (default: the task's) with pad/bos/eos and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(words if words is not None else vocabulary()))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=SPECIALS[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(directory: str | Path, *, hidden: int = 48, layers: int = 2, heads: int = 4,
                     seed: int = 0, tie: bool = True, init_std: float = 0.02) -> Path:
    """Save a random LlamaForCausalLM (float32) and its tokenizer into ``directory``; return it.
    ``init_std``: the weights' init scale; with a larger one than Llama's 0.02 the frozen (tied)
    head of a random base spans logits wide enough for LoRA adapters alone to fit the task."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    directory = Path(directory)
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=tie, initializer_range=init_std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompt_completion_records(n: int = 48, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    items = list(FACTS.items())
    return [{"prompt": f"color of {k} ?", "completion": v} for k, v in (rng.choice(items) for _ in range(n))]


def messages_records(n: int = 48, seed: int = 0, system: bool = True) -> list[dict]:
    rng = random.Random(seed)
    items = list(FACTS.items())
    out = []
    for _ in range(n):
        (k1, v1), (k2, v2) = rng.choice(items), rng.choice(items)
        msgs = [{"role": "system", "content": "you are a helpful model"}] if system else []
        msgs += [{"role": "user", "content": f"color of {k1} ?"}, {"role": "assistant", "content": v1},
                 {"role": "user", "content": f"what is the color of {k2} ?"}, {"role": "assistant", "content": v2}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def lognormal_records(n: int = 64, seed: int = 0, median_words: float = 16.0, sigma: float = 1.0,
                      max_words: int = 110) -> list[dict]:
    """Prompt-completion records of the lookup task whose prompts are padded with filler words to a
    lognormal number of words (``median_words``, ``sigma``; clipped to 0..``max_words``), so the
    sequence lengths vary as post-training lengths do (one token per word)."""
    rng = random.Random(seed)
    items = list(FACTS.items())
    filler = "please tell me what is the answer".split()
    out = []
    for _ in range(n):
        k, v = rng.choice(items)
        words = min(int(rng.lognormvariate(math.log(median_words), sigma)), max_words)
        pad = " ".join(filler[i % len(filler)] for i in range(words))
        out.append({"prompt": f"{pad} color of {k} ?".strip(), "completion": v})
    return out
