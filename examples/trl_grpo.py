"""TRL 1.16's GRPOTrainer with raas as its rollout function, on this machine's CPU: the embedded SmolLM2-135M
is both TRL's policy (transformers, float32 from the shipped GGUF) and what llama-server serves, and the
trained weights are pushed to llama-server after every step. Runs in a few minutes on 2 cores:

    .venv/bin/python examples/trl_grpo.py --steps 4

It starts its own raas service (in this process) on the built-in addition task, whose rollouts need no
sandbox. Pointing TRL at a raas service you run elsewhere is the same code with ``raas_url`` set.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from raas.cli.inprocess import service_in_process
from raas.learn.llama_sync import LlamaWeightSync
from raas.llm.models import default_gguf_path, default_tokenizer_dir, prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import load_dataset
from raas.trainer.hf_weights import load_policy
from raas.trainer.rollout import FailurePolicy
from raas.trainer.sync import SyncRolloutClient
from raas.trainer.trl_rollout import RaasRolloutFunc, RaasWeightSyncCallback, instance_index, raas_reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    args = parser.parse_args()

    # The policy TRL trains: the embedded model's weights, loaded by transformers. The GGUF loader marks the
    # model quantized, which Trainer refuses to train; load_policy removes the marker.
    policy = load_policy(default_gguf_path()).train()
    # The embedded model's tokenizer: `raas llm prepare` (run by `make install`) writes it here.
    tokenizer = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    problems = load_dataset(f"builtin:addition:{args.steps * args.prompts_per_step}")
    index = instance_index(problems, dict, prompt_column="problem")  # TRL prompt -> raas instance
    dataset = Dataset.from_list([{"prompt": p["problem"]} for p in problems])

    # raas's asynchronous pieces (llama-server, which serves the policy, and the service) live on an event
    # loop in a thread of their own; TRL's synchronous loop calls into it.
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    with tempfile.TemporaryDirectory(prefix="raas-trl-") as tmp:
        llama = LlamaWeightSync(
            policy, template=default_gguf_path(), parallel=4, ctx_per_slot=1024, workdir=Path(tmp) / "policy"
        )
        on_loop(llama.__aenter__())
        service = service_in_process(
            ServiceConfig(
                state_dir=Path(tmp) / "svc",
                llm_servers=[llama.url],
                tokenizer_dir=prepare_tokenizer(),
                run_workers=4,
                shutdown_grace_s=0.0,
            )
        )
        raas_url = on_loop(service.__aenter__())
        try:

            def push_weights(model: Any, step: int) -> None:
                """Runs while raas holds new generate calls: the trained weights go to llama-server."""
                on_loop(llama.write())
                on_loop(llama.restart())

            with SyncRolloutClient(
                raas_url, policy=FailurePolicy(min_group_size=args.generations, refill=True)
            ) as c:
                trainer = GRPOTrainer(
                    model=policy,
                    processing_class=tokenizer,
                    train_dataset=dataset,
                    reward_funcs=[raas_reward],
                    rollout_func=RaasRolloutFunc(c, index),
                    callbacks=[RaasWeightSyncCallback(c, push_weights)],
                    args=GRPOConfig(
                        output_dir=str(Path(tmp) / "trl"),
                        max_steps=args.steps,
                        per_device_train_batch_size=args.generations * args.prompts_per_step,
                        num_generations=args.generations,
                        max_completion_length=16,
                        temperature=1.0,
                        learning_rate=1e-5,
                        beta=0.0,
                        use_cpu=True,
                        report_to="none",
                        save_strategy="no",
                        logging_steps=1,
                    ),
                )
                trainer.train()
        finally:
            on_loop(service.__aexit__(None, None, None))
            on_loop(llama.__aexit__(None, None, None))
            loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
