"""The run config: typed TOML sections, every key described, unknown keys refused; its one resolve pass.
May import only the foundations (errors, userfiles): the facts it resolves from are handed in.

`load_config(path, overrides)` reads what the user asked (every mistake a `ConfigError` naming the
file and the key); `resolve.resolve(cfg, facts)` makes it the run's: every "auto" concrete and every
derived key filled, once, by preflight. Rooms: `section` (the base), `data`, `model`, `train` and
`run` (the sections; `run` the root and the rules across sections), `model_names` (the syntax of
model.name), `load` (the file and `--set`), `errors` (pydantic's errors as one line), `resolve`,
`reference` (the docs' config page).
"""

from ddp_cli.config.data import AugmentConfig, DataConfig
from ddp_cli.config.load import apply_override, load_config, unknown_key
from ddp_cli.config.model import (
    ModelConfig,
    ModelSource,
    OptimConfig,
    PretrainConfig,
    ScheduleConfig,
    SemiConfig,
)
from ddp_cli.config.run import RunConfig, config_from_dict
from ddp_cli.config.train import (
    EMA_BN_IMAGES,
    CheckpointConfig,
    DistributedConfig,
    LoggingConfig,
    MlflowConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = ["EMA_BN_IMAGES", "AugmentConfig", "CheckpointConfig", "DataConfig", "DistributedConfig",
           "LoggingConfig", "MlflowConfig", "ModelConfig", "ModelSource", "OptimConfig", "PretrainConfig",
           "RunConfig", "ScheduleConfig", "SemiConfig", "TrainConfig", "WandbConfig", "apply_override",
           "config_from_dict", "load_config", "unknown_key"]
