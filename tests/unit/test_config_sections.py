"""Config sections: the research options live in `experimental`; a recipe or an override still naming
their old place in `outer` is an error that says where they moved; a run record written before the move
still opens, with the keys at their new place.
Run: .venv/bin/pytest tests/unit/test_config_sections.py -q
"""

from __future__ import annotations

import pytest

from diloco.configs import ConfigError, config_from_record, load_config

MOVED = {"backlog_momentum": "whole", "momentum_per": "round"}


def test_research_options_are_in_the_experimental_section_with_their_defaults():
    cfg = load_config("tiny")
    assert (cfg.experimental.backlog_momentum, cfg.experimental.momentum_per) == ("round_rate", "merge")
    assert not {"backlog_momentum", "momentum_per"} & set(cfg.outer.model_dump())
    moved = cfg.with_overrides({f"experimental.{k}": v for k, v in MOVED.items()})
    assert (moved.experimental.backlog_momentum, moved.experimental.momentum_per) == ("whole", "round")


@pytest.mark.parametrize("key", sorted(MOVED))
def test_an_override_at_the_old_place_says_where_the_key_moved(key):
    with pytest.raises(ConfigError, match=rf"outer\.{key} moved to experimental\.{key}"):
        load_config("tiny").with_overrides({f"outer.{key}": MOVED[key]})


@pytest.mark.parametrize("key", sorted(MOVED))
def test_a_recipe_at_the_old_place_says_where_the_key_moved(tmp_path, key):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"outer: {{lr: 0.5, {key}: {MOVED[key]}}}\n")
    with pytest.raises(ConfigError, match=rf"outer\.{key} moved to experimental\.{key}") as err:
        load_config(str(recipe))
    assert str(recipe) in str(err.value)


def test_a_run_record_from_before_the_move_opens_with_the_keys_moved():
    record = load_config("tiny").model_dump(mode="json")
    del record["experimental"]
    record["outer"].update(MOVED)
    cfg = config_from_record(record)
    assert (cfg.experimental.backlog_momentum, cfg.experimental.momentum_per) == ("whole", "round")
    assert config_from_record(cfg.model_dump(mode="json")) == cfg


def test_a_knob_without_effect_on_the_chosen_path_is_named_once() -> None:
    from diloco.configs import load_config
    from diloco.configs.effects import knob_warnings

    cfg = load_config("tiny").with_overrides({"run.warm_standby": True, "learner.mode": "sync"})
    overrides = {"run.warm_standby": True, "learner.mode": "sync", "run.num_learners": None}
    fork = knob_warnings("tiny", overrides, cfg, "fork")
    assert len(fork) == 2 and fork[0].startswith("run.warm_standby has no effect here")
    assert "learner.probe_every_steps" in fork[1]  # set by the tiny recipe, and a sync learner never probes
    assert knob_warnings("tiny", overrides, cfg, "exec") == fork[1:]
    assert [w.split()[0] for w in knob_warnings("tiny", {}, load_config("tiny"), "prefect")] == []
    # a local Prefect run forks its flow runs from the zygote too (start_method matters there), not
    # deployments
    assert knob_warnings("tiny", {"run.start_method": "exec"}, cfg, "prefect") == fork[1:]
    assert knob_warnings("tiny", {"run.start_method": "exec"}, cfg,
                         "deployments")[0].startswith("run.start_method")


def test_a_removed_key_is_refused_with_its_reason_and_an_old_record_still_opens() -> None:
    import pytest

    from diloco.configs import ConfigError, config_from_record, load_config

    with pytest.raises(ConfigError, match="learner.slowdown was removed: .*chaos plan"):
        load_config("tiny").with_overrides({"learner.slowdown": 2.0})
    record = load_config("tiny").model_dump(mode="json")
    record["learner"]["slowdown"] = 1.0
    assert config_from_record(record) == load_config("tiny")
