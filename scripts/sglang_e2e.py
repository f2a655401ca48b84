"""End-to-end check of SGLangEngine against a real SGLang server (run on a GPU machine).

    pip install -e '.[train,sglang]' && python scripts/sglang_e2e.py [--model PATH] [--port 30000]

It launches a server on the tiny preset (or the model you name), then checks: token-in-token-out
generation with logprobs that match a Hugging Face forward pass, stop on EOS, abort, pause/continue,
a weight update from disk that bumps the version and changes the outputs, an episode of
reflow/Calc-v0 played through the episode runner, and three sync RL steps of `reflow agent-train` with
`engine.kind: sglang` (a server launched by the rollout worker, each policy handed over from disk).
Prints one line per check; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile

import torch

from reflow.engine import SamplingParams
from reflow.engine.sglang_engine import SGLangEngine


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}")
    return ok


async def main(model_path: str, port: int) -> int:
    import reflow
    from reflow.models import load_model, resolve_model_path
    from reflow.rollout.episode import EpisodeRunner, RolloutConfig

    path = str(resolve_model_path(model_path))
    model, tok = load_model(path, device="cuda")
    engine = SGLangEngine.launch(path, ports=[port], extra_args=["--mem-fraction-static", "0.3"])
    results = []
    try:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
        )
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=32, temperature=1.0, seed=0))
        ids = torch.tensor([prompt + out.output_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        ref = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
        diff = (ref - torch.tensor(out.logprobs)).abs().max().item()
        results.append(
            check("logprobs match an HF forward pass", diff < 2e-2, f"max diff {diff:.2e} (bf16 kernels)")
        )
        greedy = await engine.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        results.append(
            check("finish reason reported", greedy.finish_reason in ("stop", "length"), greedy.finish_reason)
        )

        task = asyncio.create_task(
            engine.generate(prompt, SamplingParams(max_new_tokens=4000, temperature=1.0), "abort-me")
        )
        await asyncio.sleep(0.5)
        await engine.abort("abort-me")
        aborted = await task
        results.append(check("abort", aborted.finish_reason == "abort", aborted.finish_reason))

        await engine.pause("abort")
        await engine.resume()
        with tempfile.TemporaryDirectory() as tmp:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            version = await engine.update_weights(path=tmp)
            after = await engine.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
        results.append(
            check(
                "weight update bumps the version",
                after.weight_version == version == 1,
                str(after.weight_version),
            )
        )
        results.append(check("weight update changes outputs", after.output_ids != greedy.output_ids))

        runner = EpisodeRunner(engine, tok, RolloutConfig(sampling=SamplingParams(max_new_tokens=64)))
        rec = await runner.run(reflow.make("reflow/Calc-v0"), seed=0)
        results.append(
            check("Calc episode through the runner", rec.status in ("ok", "truncated"), rec.status)
        )
    finally:
        await engine.close()
    results.append(agent_train_leg(path, port + 1))
    return 0 if all(results) else 1


def agent_train_leg(model_path: str, port: int) -> bool:
    """`reflow agent-train` for 3 sync steps with the rollout worker's own SGLang server."""
    from reflow.config import load_config
    from reflow.recipes.agent_train import train
    from reflow.recipes.run_log import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            None,
            [
                "env.id=reflow/Calc-v0",
                f"model={model_path}",
                "warmstart.enabled=false",
                "train.steps=3",
                "eval.every=0",
                "eval.episodes=8",
                "resources.device=cuda",
                "resources.gpus_per_slot=0.5",  # the rollout and train slots share one GPU
                "engine.kind=sglang",
                f"engine.launch_port={port}",
                "engine.launch_args=[--mem-fraction-static, '0.2']",
                f"out_dir={tmp}",
            ],
        )
        summary = train(config)
        versions = [s["version"] for s in read_metrics(config.run_dir, "step")]
    return check(
        "agent-train with engine.kind sglang", summary["steps"] == 3 and versions == [1, 2, 3], str(versions)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, default=30000)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.model, args.port)))
