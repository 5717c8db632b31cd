#!/usr/bin/env bash
# LACONIC on verl 0.9: GRPO whose advantages are taken of the Lagrangian reward r - lambda * max((L - B)/B, 0), with
# lambda's dual step once per actor update and lambda saved in every global_step_N checkpoint folder
# (laconic_nemo/integrations/verl.py, docs/integrations.md). The first six overrides (adv_estimator,
# checkpoint_callback_class, +algorithm.laconic.*) are all that LACONIC adds to a verl GRPO command; the rest is an
# ordinary verl run (math parquet files prepared with verl's examples/data_preprocess scripts).
#
#   pip install "verl[vllm]==0.9.1" && pip install -e .        # on the GPU machine
#   DATA=$HOME/data bash examples/integrations/verl_laconic.sh trainer.n_gpus_per_node=8
set -euo pipefail
DATA=${DATA:-$HOME/data}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=laconic \
    trainer.checkpoint_callback_class=laconic_nemo.integrations.verl.LaconicCheckpointCallback \
    +algorithm.laconic.budget=1000 \
    +algorithm.laconic.eta=0.002 \
    +algorithm.laconic.max_length=4096 \
    +algorithm.laconic.lambda_init=0.0 \
    algorithm.norm_adv_by_std_in_grpo=True \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA/math/train.parquet" \
    data.val_files="$DATA/math/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.default_local_dir=checkpoints/verl_laconic \
    trainer.save_freq=20 \
    trainer.total_epochs=1 \
    trainer.logger='["console"]' \
    "$@"
