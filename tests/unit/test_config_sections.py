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
