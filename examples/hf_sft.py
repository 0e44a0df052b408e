"""Supervised fine-tuning of a local Hugging Face model on JSONL data through a Shardline cluster.

One process per rank, as torchrun starts them (RANK / WORLD_SIZE from the environment):

    shardline up --ps 2 --workers 1 --steps 100000 &     # a cluster (training its demo job meanwhile),
                                                           # or your own; note its address and token file
    export SHARDLINE_CLUSTER_TOKEN_FILE=...                # what `shardline up` printed
    torchrun --nproc-per-node 2 examples/hf_sft.py --cluster 127.0.0.1:7000 --job sft-1 \\
        --model ./my-model --data train.jsonl --lora-r 8 --steps 100

``--model`` is a ``save_pretrained`` directory (loaded with ``local_files_only``: nothing is
downloaded); ``--data`` a JSONL file of ``{"prompt", "completion"}`` (``--format prompt_completion``)
or ``{"messages": [...]}`` lines (``--format messages``, the tokenizer's chat template), loss on the
completion / assistant tokens only. No torch.distributed process group is made: the cluster
averages the gradients. Every rank reads the same global minibatch, splits it by token cost
(``shardline.plan_rank``), and pushes with its number of loss tokens as weight, so each step
equals one process training on the whole minibatch. With ``--lora-r`` only the adapters train (and
move over the network). ``opt.version`` resumes a job that was interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="dispatcher HOST:PORT")
    p.add_argument("--job", required=True)
    p.add_argument("--model", required=True, help="a local save_pretrained directory")
    p.add_argument("--data", required=True, help="JSONL training data")
    p.add_argument("--format", default="prompt_completion", choices=("prompt_completion", "messages"))
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all ranks")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from shardline import PSOptimizer, plan_rank
    from shardline.jobs.data.batch import collate
    from shardline.jobs.data.jsonl import JsonlSFT
    from shardline.jobs.models.hf import load_model, load_tokenizer
    from shardline.jobs.spec import LoraSpec

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tokenizer = load_tokenizer(args.model)
    lora = LoraSpec(r=args.lora_r, alpha=args.lora_alpha, target_modules="all-linear") if args.lora_r else None
    model = load_model(args.model, args.dtype, lora, seed=args.seed)
    data = JsonlSFT(args.data, args.format, args.max_length, args.seed, tokenizer)

    # No weight decay on biases and norms: two param groups, as the usual recipe has.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name else decay).append((name, p))
    groups = [g for g in ({"params": decay, "weight_decay": args.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opt = PSOptimizer(groups, cluster=args.cluster, job=args.job, optimizer="adamw", lr=args.lr,
                      max_grad_norm=args.max_grad_norm or None)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)) * max(0.0, 1 - s / args.steps))
    for _ in range(opt.version):  # a resumed job: bring the schedule to where the job is
        schedule.step()

    model.train()
    for step in range(opt.version, args.steps):
        examples = data.examples_at(step * args.global_batch, args.global_batch)  # the same on every rank
        lengths = [len(ids) for ids, _labels in examples]
        loss_tokens = [sum(1 for t in labels[1:] if t != -100) for _ids, labels in examples]
        plan = plan_rank(lengths, world, rank, loss_tokens=loss_tokens, micro_batch_tokens=args.micro_batch_tokens)
        opt.zero_grad()
        opt.set_step_weight(plan.weight)  # the gradients go out during the last backward, with the weight
        total = 0.0
        for j, micro in enumerate(plan.micro_batches):
            batch = collate([examples[i] for i in micro], pad_id=data.pad_id)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.input_ids != batch.pad_id).logits
            summed = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                                                       ignore_index=-100, reduction="sum")
            last = j == len(plan.micro_batches) - 1
            with contextlib.nullcontext() if last else opt.no_sync():  # only the last backward pushes
                (summed * plan.loss_scale).backward()
            total += float(summed.detach())
        opt.step()
        schedule.step()
        if rank == 0:
            print(f"step {opt.version}/{args.steps} rank-0 loss/token {total / max(1, plan.loss_tokens):.4f} "
                  f"lr {opt.param_groups[0]['lr']:.2e}", flush=True)
    opt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
