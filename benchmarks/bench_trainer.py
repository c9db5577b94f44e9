"""Trainer compute throughput: atroposd's learner against a straightforward reference step.

Measures, side by side in one run, tokens/s and ms/step of one optimizer step (GRPO loss with
the k3 KL toward the frozen initial model, backward, clip, AdamW) on:

* ``tiny``: builtin:tiny (331k parameters, 22-token vocabulary), the embedded job's batch
  (64 sequences of a 4-token prompt + 4-token completion, 2 micro-batches of 32);
* ``100m``: a ~100M-parameter Llama (hidden 768, 8 layers, 32k vocabulary), 8 sequences of
  48 prompt + 16 completion tokens, micro-batches of 4.

Both implementations run interleaved step by step, so they see the same machine load. The
reference is the predecessor's shape of the same loss: full ``[B, T, V]`` logits for the
policy, again scaled by the temperature, a second cross-entropy over them for metrics, and
the reference model's full logits — all positions, prompt included.

usage: python benchmarks/bench_trainer.py [--steps N] [--only tiny|100m]
Prints a table and a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atroposd.trainer.batch import RolloutBatch, prepare_batch
from atroposd.trainer.learner import GrpoObjective, InitialReference, Learner
from atroposd.trainer.model import Policy

CLIP, KL, LR = 0.2, 0.04, 3e-4


def make_groups(n_seq: int, group: int, prompt: int, completion: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    groups = []
    for _ in range(n_seq // group):
        toks, masks, lps = [], [], []
        for _ in range(group):
            p = [1] + [rng.randrange(4, vocab) for _ in range(prompt - 1)]
            c = [rng.randrange(4, vocab) for _ in range(completion)]
            toks.append(p + c)
            masks.append([-100] * prompt + c)
            lps.append([1.0] * prompt + [-rng.uniform(1, 4) for _ in c])
        groups.append({"tokens": toks, "masks": masks, "scores": [rng.random() for _ in range(group)],
                       "inference_logprobs": lps})
    return groups


def build_model(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "tiny":
        from atroposd.models.tiny import model_config_dict

        cfg = LlamaConfig(**model_config_dict(512))
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                          num_attention_heads=12, num_key_value_heads=12, head_dim=64, max_position_embeddings=512,
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


class ReferenceStep:
    """The predecessor's step shape: full-vocabulary logits materialised several times."""

    def __init__(self, model: torch.nn.Module, ref: torch.nn.Module) -> None:
        self.model, self.ref = model, ref
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)

    def step(self, batch: RolloutBatch) -> float:
        total = 0.0
        for mb in batch.micro:
            logits = self.model(input_ids=mb.input_ids).logits  # [B, T, V]
            t = mb.temperature[:, None, None]
            scaled = logits / t  # a second [B, T, V]
            labels = torch.where(mb.mask, mb.labels, torch.full_like(mb.labels, -100))
            logp = -torch.nn.functional.cross_entropy(scaled.transpose(1, 2), labels, reduction="none")  # [B, T]
            with torch.no_grad():
                _raw = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
                ref_logits = self.ref(input_ids=mb.input_ids).logits / t
                ref = -torch.nn.functional.cross_entropy(ref_logits.transpose(1, 2), labels, reduction="none")
            m = mb.mask.float()
            old = torch.where(torch.isnan(mb.old_logp), logp.detach(), mb.old_logp)
            r = torch.exp(logp - old)
            a = mb.advantages
            pg = -torch.minimum(r * a, r.clamp(1 - CLIP, 1 + CLIP) * a)
            d = ref - logp
            kl = torch.exp(d) - d - 1
            loss = ((pg + KL * kl) * m).sum() / batch.completion_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def bench(kind: str, steps: int) -> dict[str, Any]:
    import copy

    if kind == "tiny":
        n, group, prompt, completion, micro, vocab = 64, 8, 4, 4, 32, 22
    else:
        n, group, prompt, completion, micro, vocab = 8, 8, 48, 16, 4, 32000
    batches = [prepare_batch(make_groups(n, group, prompt, completion, vocab, s), micro_batch_size=micro,
                             max_token_len=4096, adv_std_floor=0.1) for s in range(4)]
    tokens = batches[0].completion_tokens
    model = build_model(kind)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"model": kind, "parameters": params, "sequences": n, "completion_tokens": tokens}
    runners: dict[str, Any] = {}
    for impl in ("atroposd", "reference"):
        m = copy.deepcopy(model)
        ref = copy.deepcopy(model).requires_grad_(False)
        if impl == "atroposd":
            policy = Policy(model=m, tokenizer=None, source=Path("."), device=torch.device("cpu"),
                            dtype=torch.float32, lora=False, reference=ref)
            opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
            learner = Learner(policy, opt, sched, objective=GrpoObjective(clip_eps=CLIP, kl_coef=KL),
                              reference=InitialReference(), max_grad_norm=1.0)

            def run(b: RolloutBatch, learner: Learner = learner) -> None:
                learner.compute(b)
                learner.apply()
        else:
            stepper = ReferenceStep(m, ref)

            def run(b: RolloutBatch, stepper: ReferenceStep = stepper) -> None:
                stepper.step(b)
        runners[impl] = run
    # Interleaved, step by step: both implementations see the same machine load.
    elapsed = dict.fromkeys(runners, 0.0)
    for i in range(-(1 if kind == "100m" else 2), steps):  # negative i: warm-up
        for impl, run in runners.items():
            start = time.perf_counter()
            run(batches[i % len(batches)])
            if i >= 0:
                elapsed[impl] += time.perf_counter() - start
    for impl, total in elapsed.items():
        per_step = total / steps
        out[impl] = {"ms_per_step": per_step * 1000, "tokens_per_s": tokens / per_step}
        print(f"  {kind} {impl}: {per_step * 1000:.1f} ms/step", file=sys.stderr, flush=True)
    out["speedup"] = out["reference"]["ms_per_step"] / out["atroposd"]["ms_per_step"]
    return out


def prepare_cost(steps: int) -> float:
    groups = make_groups(64, 8, 4, 4, 22, 0)
    start = time.perf_counter()
    for _ in range(steps):
        prepare_batch(groups, micro_batch_size=32, max_token_len=512, adv_std_floor=0.1)
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (default: 100 tiny, 2 for 100m)")
    ap.add_argument("--only", choices=("tiny", "100m"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory():
        results = []
        for kind in ("tiny", "100m"):
            if args.only and kind != args.only:
                continue
            results.append(bench(kind, args.steps or (100 if kind == "tiny" else 2)))
    prep = prepare_cost(50)
    print(f"{'model':<6} {'params':>11} {'tokens':>7} {'impl':<10} {'ms/step':>9} {'tokens/s':>10}")
    for r in results:
        for impl in ("atroposd", "reference"):
            print(f"{r['model']:<6} {r['parameters']:>11,} {r['completion_tokens']:>7} {impl:<10} "
                  f"{r[impl]['ms_per_step']:>9.1f} {r[impl]['tokens_per_s']:>10.0f}")
        print(f"{'':<6} speed-up atroposd / reference: {r['speedup']:.2f}x")
    print(f"batch preparation (64 x 8 tokens): {prep:.2f} ms")
    print(json.dumps({"bench": "trainer", "threads": 1, "prepare_ms": round(prep, 3),
                      "results": [{"model": r["model"], "parameters": r["parameters"],
                                   "atroposd_tokens_per_s": round(r["atroposd"]["tokens_per_s"]),
                                   "reference_tokens_per_s": round(r["reference"]["tokens_per_s"]),
                                   "atroposd_ms_per_step": round(r["atroposd"]["ms_per_step"], 2),
                                   "reference_ms_per_step": round(r["reference"]["ms_per_step"], 2),
                                   "speedup": round(r["speedup"], 2)} for r in results]}))


if __name__ == "__main__":
    main()
