"""TEMPORARY shim (replaced by the storage helper's records module at merge): typed bucket records."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, ValidationError


class RecordError(ValueError):
    """A stored record is malformed."""


class LearnerStatus(BaseModel):
    model_config = ConfigDict(extra="allow")
    learner: str = ""
    state: str = ""
    t: float = 0.0


def read_record(store, key: str, cls: type[BaseModel]) -> BaseModel:
    try:
        return cls.model_validate(json.loads(store.get(key)))
    except (ValueError, ValidationError) as err:
        raise RecordError(f"{key}: {err}") from None
