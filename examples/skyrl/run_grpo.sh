#!/usr/bin/env bash
# SkyRL (skyrl-train 0.3.1) GRPO with raas as its generator: SkyRL's own config and overrides, raas's
# entrypoint (raas.integrations.skyrl = SkyRL's main_base with RaasGenerator). Needs SkyRL's GPU environment
# with raas installed in it (docs/trainers/skyrl.md), a raas service, and inference servers SkyRL can reach.
set -euo pipefail
export RAAS_URL=${RAAS_URL:-http://127.0.0.1:8008}
# a SkyRL PromptDataset parquet whose rows carry raas instances (here 512 builtin lookup instances)
python - <<'PY'
import json
import pandas as pd
from raas.tasks.datasets import load_dataset
rows = [{"prompt": [{"role": "user", "content": inst["instance_id"]}], "env_class": "raas",
         "raas_instance": json.dumps(inst)} for inst in load_dataset("builtin:lookup:512")]
pd.DataFrame(rows).to_parquet("raas_train.parquet")
PY
python -m raas.integrations.skyrl \
  data.train_data="['raas_train.parquet']" data.val_data="[]" \
  trainer.policy.model.path="${MODEL:-Qwen/Qwen3-1.7B}" \
  trainer.algorithm.advantage_estimator=grpo trainer.algorithm.grpo_norm_by_std=false \
  generator.n_samples_per_prompt=8 \
  generator.run_engines_locally=false \
  generator.remote_inference_engine_urls="${ENGINES:-['127.0.0.1:8001']}" \
  "$@"
