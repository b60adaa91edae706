"""The base of every settings section: frozen once read, and an unknown field is an error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of `Settings` (``RTRL_<SECTION>__<FIELD>``): frozen, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")
