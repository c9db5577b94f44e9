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

And the trainer at real lengths (SPEC §14), each implementation in a child process of its own
so that its peak resident memory (VmHWM, reset before the measured step) is its alone:

* ``memory``: peak memory of one training step (forward, backward, optimizer) at 4,096
  completion tokens (4 sequences of 32 prompt + 1,024 completion tokens, one micro-batch) on a
  small Qwen2-shaped model with Qwen's 151,936-token vocabulary (hidden 256, 2 layers, ~40M
  parameters, tied embeddings): the LM head in chunks of ``logprob_chunk = 1024`` positions
  against today's full ``[4096, V]`` float32 logits (the previous revision's scoring). Goal: at
  most a quarter.
* ``packing``: tokens per second of one step on a long-tailed length mix (64 sequences of
  log-normal length, median 180, clipped to [50, 2000] tokens, 32 of them prompt) on a ~50M
  Llama (hidden 512, 8 layers, 32k vocabulary): packed micro-batches
  (``micro_batch_tokens = 8192``) against padded ones at equal peak memory — the padded run's
  ``micro_batch_size`` is the largest whose largest pass peaks no higher than the packed run's
  largest pass (each measured in a child). Goal: at least 1.5x.

usage: python benchmarks/bench_trainer.py [--steps N] [--only tiny|100m|memory|packing]
Prints a table and a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atroposd.trainer.batch import RolloutBatch, prepare_batch
from atroposd.trainer.learner import GrpoObjective, InitialReference, Learner, NoReference
from atroposd.trainer.logprobs import TokenScores
from atroposd.trainer.model import Policy, use_segment_attention
from atroposd.trainer.ranks import Share

CLIP, KL, LR = 0.2, 0.04, 3e-4
PACK_TOKENS = 8192  # the packing case's micro_batch_tokens


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
        groups.append(
            {"tokens": toks, "masks": masks, "scores": [rng.random() for _ in range(group)], "inference_logprobs": lps}
        )
    return groups


def build_model(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "tiny":
        from atroposd.models.tiny import model_config_dict

        cfg = LlamaConfig(**model_config_dict(512))
    else:
        cfg = LlamaConfig(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=12,
            num_key_value_heads=12,
            head_dim=64,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
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
    batches = [
        prepare_batch(
            make_groups(n, group, prompt, completion, vocab, s),
            micro_batch_size=micro,
            max_token_len=4096,
            adv_std_floor=0.1,
        )
        for s in range(4)
    ]
    tokens = batches[0].completion_tokens
    model = build_model(kind)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"model": kind, "parameters": params, "sequences": n, "completion_tokens": tokens}
    runners: dict[str, Any] = {}
    for impl in ("atroposd", "reference"):
        m = copy.deepcopy(model)
        ref = copy.deepcopy(model).requires_grad_(False)
        if impl == "atroposd":
            policy = Policy(
                model=m,
                tokenizer=None,
                source=Path("."),
                device=torch.device("cpu"),
                dtype=torch.float32,
                lora=False,
                reference=ref,
            )
            opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
            learner = Learner(
                policy,
                opt,
                sched,
                objective=GrpoObjective(clip_eps=CLIP, kl_coef=KL),
                reference=InitialReference(),
                max_grad_norm=1.0,
            )

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


# ---------------------------------------------------------------- the trainer at real lengths


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    """VmHWM back to the current RSS (Linux: ``5`` to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def full_logits_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    teacher: Any = None,
    chunk: int = 0,
    tau: float = 1.0,
    entropy: bool = False,
) -> TokenScores:
    """The previous revision's scoring: the head on every completion position at once, one
    float32 ``[N, V]`` tensor (and autograd's tensors of the same size in the backward)."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
    hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, T, H]
    logits = head(hidden[mask]).float()  # [N, V]
    temps = temperature[:, None].expand_as(mask)[mask]
    scaled = logits / temps[:, None]
    return TokenScores(scaled.gather(1, labels[mask][:, None])[:, 0] - torch.logsumexp(scaled, dim=-1))


def build_qwen_small() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def build_llama_50m() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def long_tail_groups(vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """64 sequences (8 groups of 8), total lengths log-normal (median 180) clipped to [50, 2000]."""
    rng = random.Random(seed)
    groups = []
    for _ in range(8):
        toks, masks, lps = [], [], []
        for _ in range(8):
            total = int(min(2000, max(50, rng.lognormvariate(math.log(180), 1.0))))
            p = [1] + [rng.randrange(4, vocab) for _ in range(31)]
            c = [rng.randrange(4, vocab) for _ in range(total - 32)]
            toks.append(p + c)
            masks.append([-100] * 32 + c)
            lps.append([1.0] * 32 + [-rng.uniform(1, 4) for _ in c])
        groups.append(
            {"tokens": toks, "masks": masks, "scores": [rng.random() for _ in range(8)], "inference_logprobs": lps}
        )
    return groups


def _learner(model: torch.nn.Module, chunk: int) -> Learner:
    policy = Policy(
        model=model, tokenizer=None, source=Path("."), device=torch.device("cpu"), dtype=torch.float32, lora=False
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    return Learner(
        policy,
        opt,
        sched,
        objective=GrpoObjective(clip_eps=CLIP, kl_coef=0.0),
        reference=NoReference(),
        max_grad_norm=1.0,
        logprob_chunk=chunk,
    )


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this (fresh) process: ``memory`` (a step, chunked or full logits),
    ``pass`` (the largest pass of a packing layout) or ``step`` (a timed step of one)."""
    torch.set_num_threads(1)
    if spec["case"] == "memory":
        model = build_qwen_small()
        groups = make_groups(4, 4, 32, 1024, 151936, 0)
        batch = prepare_batch(groups, micro_batch_size=4, max_token_len=2048, adv_std_floor=0.1)
        if spec["impl"] == "full":
            import atroposd.trainer.learner as learner_module

            learner_module.token_scores = full_logits_scores  # type: ignore[assignment]
        learner = _learner(model, 1024)
        learner.compute(batch)  # a first step: the optimizer's state exists from here on
        learner.apply()
        base = _status_kb("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        learner.compute(batch)
        learner.apply()
        elapsed = time.perf_counter() - start
        return {
            "peak_mib": (_status_kb("VmHWM") - base) / 1024,
            "rss_mib": base / 1024,
            "s": elapsed,
            "tokens": batch.completion_tokens,
        }
    model = build_llama_50m()
    use_segment_attention(model)  # as load_policy does: packed rows attend per sequence
    groups = long_tail_groups(32000)
    batch = prepare_batch(
        groups,
        micro_batch_size=spec["micro_batch_size"],
        max_token_len=2048,
        adv_std_floor=0.1,
        micro_batch_tokens=spec["micro_batch_tokens"],
    )
    learner = _learner(model, 1024)
    real = sum(len(t) - 1 for g in groups for t in g["tokens"])  # the model's input positions, padding not counted
    slots = sum(int(mb.input_ids.numel()) for mb in batch.micro)
    base = _status_kb("VmRSS")
    _reset_peak()
    if spec["case"] == "pass":  # the largest pass alone
        mb = max(batch.micro, key=lambda m: int(m.input_ids.numel()))
        learner.compute_share(Share([mb], 1, None, max(batch.completion_tokens, 1), 0))
        return {"peak_mib": (_status_kb("VmHWM") - base) / 1024, "shape": list(mb.input_ids.shape)}
    start = time.perf_counter()
    learner.compute(batch)
    learner.apply()
    elapsed = time.perf_counter() - start
    return {
        "peak_mib": (_status_kb("VmHWM") - base) / 1024,
        "s": elapsed,
        "tokens": real,
        "slots": slots,
        "passes": len(batch.micro),
        "completion_tokens": batch.completion_tokens,
    }


def _in_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} exited {proc.returncode}: {proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load"] = [round(x, 1) for x in os.getloadavg()]  # the machine's 1/5/15-minute load after the child
    print(f"  {spec}: {out}", file=sys.stderr, flush=True)
    return out


def bench_memory() -> dict[str, Any]:
    chunked = _in_child({"case": "memory", "impl": "chunked"})
    full = _in_child({"case": "memory", "impl": "full"})
    return {"chunked": chunked, "full": full, "ratio": chunked["peak_mib"] / full["peak_mib"]}


def bench_packing() -> dict[str, Any]:
    packed_pass = _in_child({"case": "pass", "micro_batch_size": 1, "micro_batch_tokens": PACK_TOKENS})
    chosen, passes = 1, {}
    for size in (1, 2, 4, 8, 16):
        passes[size] = _in_child({"case": "pass", "micro_batch_size": size, "micro_batch_tokens": 0})
        if passes[size]["peak_mib"] <= packed_pass["peak_mib"] * 1.05:
            chosen = size
        else:
            break
    packed = _in_child({"case": "step", "micro_batch_size": 1, "micro_batch_tokens": PACK_TOKENS})
    padded = _in_child({"case": "step", "micro_batch_size": chosen, "micro_batch_tokens": 0})
    return {
        "packed": packed,
        "padded": padded,
        "micro_batch_size": chosen,
        "packed_pass": packed_pass,
        "padded_passes": passes,
        "speedup": padded["s"] / packed["s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="timed steps per case (default: 100 tiny, 2 for 100m)")
    ap.add_argument("--only", choices=("tiny", "100m", "memory", "packing"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory():
        results = []
        for kind in ("tiny", "100m"):
            if args.only and kind != args.only:
                continue
            results.append(bench(kind, args.steps or (100 if kind == "tiny" else 2)))
    memory = bench_memory() if args.only in (None, "memory") else None
    packing = bench_packing() if args.only in (None, "packing") else None
    prep = prepare_cost(50)
    if results:
        print(f"{'model':<6} {'params':>11} {'tokens':>7} {'impl':<10} {'ms/step':>9} {'tokens/s':>10}")
    for r in results:
        for impl in ("atroposd", "reference"):
            print(
                f"{r['model']:<6} {r['parameters']:>11,} {r['completion_tokens']:>7} {impl:<10} "
                f"{r[impl]['ms_per_step']:>9.1f} {r[impl]['tokens_per_s']:>10.0f}"
            )
        print(f"{'':<6} speed-up atroposd / reference: {r['speedup']:.2f}x")
    if memory is not None:
        c, f = memory["chunked"], memory["full"]
        print(f"peak memory of one step, {c['tokens']} completion tokens, vocabulary 151,936 (~40M Qwen2-shaped):")
        print("  (peak above the resident model and optimizer state; in brackets the whole process's peak)")
        print(
            f"  chunked (logprob_chunk 1024): {c['peak_mib']:8.0f} MiB ({c['peak_mib'] + c['rss_mib']:6.0f})  "
            f"{c['s']:6.1f} s/step"
        )
        print(
            f"  full logits (previous):       {f['peak_mib']:8.0f} MiB ({f['peak_mib'] + f['rss_mib']:6.0f})  "
            f"{f['s']:6.1f} s/step"
        )
        print(
            f"  chunked / full: {memory['ratio']:.3f} (whole process: "
            f"{(c['peak_mib'] + c['rss_mib']) / (f['peak_mib'] + f['rss_mib']):.3f})"
        )
    if packing is not None:
        pk, pd = packing["packed"], packing["padded"]
        print(f"long-tailed mix, 64 sequences, {pk['tokens']} tokens (~50M Llama), equal peak memory:")
        print(
            f"  packed (micro_batch_tokens {PACK_TOKENS}): {pk['passes']:3d} passes {pk['slots']:7d} slots "
            f"{pk['peak_mib']:7.0f} MiB {pk['s']:7.1f} s {pk['tokens'] / pk['s']:8.1f} tokens/s"
        )
        print(
            f"  padded (micro_batch_size {packing['micro_batch_size']:>2}):    {pd['passes']:3d} passes "
            f"{pd['slots']:7d} slots {pd['peak_mib']:7.0f} MiB {pd['s']:7.1f} s {pk['tokens'] / pd['s']:8.1f} tokens/s"
        )
        print(
            f"  packed / padded: {packing['speedup']:.2f}x (load average after each step, 1/5/15 min: "
            f"packed {pk['load']}, padded {pd['load']})"
        )
    print(f"batch preparation (64 x 8 tokens): {prep:.2f} ms")
    print(
        json.dumps(
            {
                "bench": "trainer",
                "threads": 1,
                "prepare_ms": round(prep, 3),
                "results": [
                    {
                        "model": r["model"],
                        "parameters": r["parameters"],
                        "atroposd_tokens_per_s": round(r["atroposd"]["tokens_per_s"]),
                        "reference_tokens_per_s": round(r["reference"]["tokens_per_s"]),
                        "atroposd_ms_per_step": round(r["atroposd"]["ms_per_step"], 2),
                        "reference_ms_per_step": round(r["reference"]["ms_per_step"], 2),
                        "speedup": round(r["speedup"], 2),
                    }
                    for r in results
                ],
                **(
                    {
                        "memory": {
                            "chunked_peak_mib": round(memory["chunked"]["peak_mib"]),
                            "full_peak_mib": round(memory["full"]["peak_mib"]),
                            "ratio": round(memory["ratio"], 3),
                        }
                    }
                    if memory
                    else {}
                ),
                **(
                    {
                        "packing": {
                            "packed_tokens_per_s": round(packing["packed"]["tokens"] / packing["packed"]["s"], 1),
                            "padded_tokens_per_s": round(packing["packed"]["tokens"] / packing["padded"]["s"], 1),
                            "padded_micro_batch_size": packing["micro_batch_size"],
                            "packed_peak_mib": round(packing["packed"]["peak_mib"]),
                            "padded_peak_mib": round(packing["padded"]["peak_mib"]),
                            "speedup": round(packing["speedup"], 2),
                        }
                    }
                    if packing
                    else {}
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
