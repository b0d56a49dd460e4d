#!/usr/bin/env python3
"""AReaL's online training script on rollgate: the whole change is the three marked lines.

    python examples/areal/train.py --config examples/areal/config.yaml

AReaL's own `examples/openclaw/train.py` is `PPOTrainer(config).train()`: with
`rollout.agent.mode: online` and no workflow, AReaL starts its proxy gateway and runs
`OpenAIProxyWorkflow(mode="online")`. Here rollgate is the gateway, and the workflow reads
rollgate's published episodes. Needs AReaL (and GPUs), which this repository does not run;
`examples/areal/demo.py` runs the same workflow against `make run` on a laptop.
"""

from __future__ import annotations

import sys

from areal import PPOTrainer  # type: ignore[import-not-found]
from areal.api.cli_args import PPOConfig, load_expr_config  # type: ignore[import-not-found]

from rollgate.areal_workflow import WeightSync, attach_weight_sync, with_rollgate_section


def main(argv: list[str]) -> None:
    """AReaL's train.py, with rollgate's workflow and weight-sync hook."""
    # (0) AReaL's config class refuses unknown sections: let it keep `rollgate:`.
    config, config_file = load_expr_config(argv, with_rollgate_section(PPOConfig))
    with PPOTrainer(config) as trainer:
        # (1) AReaL's pause / set_version / resume around each weight update reach rollgate.
        attach_weight_sync(trainer.rollout, WeightSync.from_config(config_file))
        # (2) rollgate's episodes instead of AReaL's proxy (workflow=None before).
        trainer.train(
            workflow="rollgate.areal_workflow.RollgateWorkflow",
            workflow_kwargs={"config": config_file},
        )


if __name__ == "__main__":
    main(sys.argv[1:])
