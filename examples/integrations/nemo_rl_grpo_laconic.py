"""NeMo-RL GRPO with LACONIC: NeMo-RL's own set-up and training loop, plus the lines marked LACONIC.

Run where NeMo-RL is installed (it is not on PyPI), from NeMo-RL's checkout so that its example configs resolve:

    uv run python examples/integrations/nemo_rl_grpo_laconic.py --config examples/integrations/nemo_rl_grpo_laconic.yaml

The data and environment set-up follow NeMo-RL's examples/run_grpo.py; only the LACONIC lines are this project's.
"""

import argparse

from nemo_rl.algorithms import grpo
from nemo_rl.algorithms.grpo import MasterConfig, setup
from nemo_rl.algorithms.utils import get_tokenizer
from nemo_rl.data.utils import setup_response_data
from nemo_rl.distributed.virtual_cluster import init_ray
from nemo_rl.models.generation import configure_generation_config
from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
from omegaconf import OmegaConf

from laconic_nemo.integrations.nemo_rl import LaconicRewardShaping  # LACONIC


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args()
    register_omegaconf_resolvers()
    config = load_config(args.config)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    config = MasterConfig(**OmegaConf.to_container(config, resolve=True))

    init_ray()
    tokenizer = get_tokenizer(config.policy["tokenizer"])
    config.policy["generation"] = configure_generation_config(config.policy["generation"], tokenizer)
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(tokenizer, config.data, config.env)
    (policy, policy_generation, _nemo_gym, _cluster, dataloader, val_dataloader, loss_fn, logger, checkpointer,
     grpo_state, master_config, _teachers, _aliases) = setup(config, tokenizer, dataset, val_dataset)

    # LACONIC: lambda restored from the latest checkpoint, kept in training_info.json, the shaping step replaced
    LaconicRewardShaping.from_config(master_config, logger=logger).attach(master_config, checkpointer, grpo_state)

    with checkpointer:
        grpo.grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
                        val_task_to_env, logger, checkpointer, grpo_state, master_config)


if __name__ == "__main__":
    main()
