#!/usr/bin/env bash
# verl 0.9.1's own GRPO trainer with raas running the rollouts: only configuration changes (the lines marked
# "raas"). Needs verl's GPU environment with raas installed in it (docs/trainers/verl.md) and a raas service.
set -euo pipefail
export RAAS_URL=${RAAS_URL:-http://127.0.0.1:8008}   # raas: where the checkpoint manager and agent loop find it
here=$(cd "$(dirname "$0")" && pwd)
# raas: a verl dataset whose rows carry raas instances (here 512 builtin lookup instances)
python - <<'PY'
import pandas as pd
from raas.integrations.verl_data import verl_rows
from raas.tasks.datasets import load_dataset
pd.DataFrame(verl_rows(load_dataset("builtin:lookup:512"))).to_parquet("raas_train.parquet")
PY
python -m verl.trainer.main_ppo \
  data.train_files=raas_train.parquet data.val_files=raas_train.parquet \
  data.max_prompt_length=2048 data.max_response_length=8192 data.train_batch_size=64 \
  actor_rollout_ref.model.path="${MODEL:-Qwen/Qwen3-1.7B}" \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$here/raas_agent_loops.yaml" `# raas` \
  actor_rollout_ref.rollout.agent.default_agent_loop=raas `# raas` \
  +actor_rollout_ref.rollout.checkpoint_manager_class=raas.integrations.verl.RaasCheckpointEngineManager `# raas` \
  algorithm.adv_estimator=raas_grpo `# raas` \
  "$@"
