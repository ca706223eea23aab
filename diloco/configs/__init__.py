"""Typed configuration: pydantic models and the YAML recipes (tiny, demo, bench)."""

from diloco.configs.schema import (
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    ExperimentalConfig,
    FragmentsConfig,
    InnerConfig,
    LearnerConfig,
    MergerConfig,
    ModelConfig,
    OuterConfig,
    RunConfig,
    StateConfig,
    config_from_record,
    load_config,
    recipe_names,
)
from diloco.configs.values import parse_overrides, parse_value, typed_value

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ExperimentalConfig",
    "FragmentsConfig",
    "InnerConfig",
    "LearnerConfig",
    "MergerConfig",
    "ModelConfig",
    "OuterConfig",
    "RunConfig",
    "StateConfig",
    "config_from_record",
    "load_config",
    "parse_overrides",
    "parse_value",
    "recipe_names",
    "typed_value",
]
