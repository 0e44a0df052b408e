"""One worker of the Trainer test: ``transformers.Trainer`` drives a PSOptimizer and a scheduler.

    python hf_trainer_worker.py CLUSTER JOB RANK WORLD MODEL_DIR DATA.jsonl STEPS OUT_DIR

Each process is a plain single-process Trainer (no torch.distributed): the cluster does the
averaging. It trains its share of the JSONL examples and writes OUT_DIR/rank<R>.safetensors (the
final parameters) and rank<R>.json (version, logged losses, final lr).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(argv):
    cluster, job, rank, world, model_dir, data, steps, out_dir = argv
    rank, world, steps = int(rank), int(world), int(steps)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from transformers import get_linear_schedule_with_warmup

    from shardline import PSOptimizer
    from shardline.jobs.data.jsonl import read_jsonl, tokenize_prompt_completion

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    records = read_jsonl(data, "prompt_completion")[rank::world]
    examples = []
    for r in records:
        ids, labels = tokenize_prompt_completion(tokenizer, r["prompt"], r["completion"])
        examples.append({"input_ids": ids, "labels": labels})

    def collate(batch):
        width = max(len(b["input_ids"]) for b in batch)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([b["input_ids"] + [pad] * (width - len(b["input_ids"])) for b in batch])
        labels = torch.tensor([b["labels"] + [-100] * (width - len(b["labels"])) for b in batch])
        return {"input_ids": ids, "labels": labels, "attention_mask": (ids != pad).long()}

    opt = PSOptimizer(model, cluster=cluster, job=job, optimizer="adamw", lr=5e-3, weight_decay=0.0,
                      world_size=world, rank=rank, max_grad_norm=1.0, connect_timeout=60, pull_timeout=120)
    scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps)
    args = TrainingArguments(output_dir=str(Path(out_dir) / f"trainer-{rank}"), max_steps=steps,
                             per_device_train_batch_size=4, max_grad_norm=0.0,  # the PS clips the mean
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=rank,
                             dataloader_drop_last=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collate,
                      optimizers=(opt, scheduler))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    save_file({k: v.detach().clone() for k, v in model.named_parameters()},  # tied weights once
              str(Path(out_dir) / f"rank{rank}.safetensors"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"version": opt.version, "losses": losses, "lr": opt.param_groups[0]["lr"],
         "wrapped": type(trainer.optimizer).__name__}))
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
