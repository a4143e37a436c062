"""The base every CRD model shares: a leaf module, so that models.py and the modules it composes
(schedule.py) import it without importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error, not silently dropped."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
