"""Writes this directory's checkpoints of format 1 (kept as test data: that atroposd is gone).

Run with the atroposd of commit f6c261d (the last one that wrote format 1), from the repository:

    .venv/bin/python tests/data/checkpoints-format1/make.py WORK_DIR

In WORK_DIR: ``model/`` (a 3,120-parameter Llama with builtin:tiny's tokenizer), then the job of
``tests.trainer.rank_zero`` with one rank and with two (three steps, a checkpoint after step 2),
``one-checkpoints/step-2`` and ``two-checkpoints/step-2``, ``expected.json`` (each job's losses and
a sha256 of its weights after step 3) and ``<job>-step3.safetensors`` (those weights). The model is named relative to
the job's working
directory ("model"), as the checkpoints name it.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_ranks import build_llama  # noqa: E402

from tests.support import write_config  # noqa: E402

SIZE = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
)


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)
    if not Path("model").exists():
        build_llama(Path("model"), SIZE)
    results = {}
    for name, devices in (("one", "cpu"), ("two", ["cpu", "cpu"])):
        write_config(
            Path(f"{name}.toml"),
            {
                "daemon": {"state_dir": name, "runtime_dir": f"{name}/run"},
                "inference": {"model": "model", "max_model_len": 512},
                "trainer": {
                    "device": devices,
                    "batch_size": 32,
                    "micro_batch_size": 8,
                    "max_token_len": 64,
                    "weight_sync": "reload",
                    "checkpoint_dir": f"{name}-checkpoints",
                },
            },
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.trainer.rank_zero",
                f"{name}.toml",
                f"{name}.pt",
                "--steps",
                "3",
                "--checkpoint-at",
                "2",
            ],
            check=True,
            env=env,
        )
        out = torch.load(f"{name}.pt", weights_only=False)
        h = hashlib.sha256()
        for k in sorted(out["params"]):
            h.update(k.encode())
            h.update(out["params"][k].contiguous().numpy().tobytes())
        results[name] = {"losses": out["losses"], "params_sha256": h.hexdigest()}
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in out["params"].items() if k != "lm_head.weight"}, f"{name}-step3.safetensors"
        )
    Path("expected.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
