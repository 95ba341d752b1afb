from rlsys.config.loader import ConfigError, build_config, config_to_dict, load_config
from rlsys.config.schema import EvalJobConfig, TrainJobConfig

__all__ = ["ConfigError", "EvalJobConfig", "TrainJobConfig", "build_config", "config_to_dict", "load_config"]
