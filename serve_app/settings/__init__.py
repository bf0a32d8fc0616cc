"""The one base of every configuration model: the app's args (``serve_app.config``), auth,
telemetry and the region files. Unknown keys are errors, named with their path, so a typo fails
the deploy instead of being ignored. (Request bodies are not settings: ``router/strict.py``.)"""

from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, ValidationError


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FrozenSettings(Settings):
    """Settings read as facts, never changed after loading (the region files)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def listed_twice(items: Iterable[str]) -> list[str]:
    """The items that appear more than once, sorted: what a "listed twice" error names."""
    return sorted(item for item, n in Counter(items).items() if n > 1)


def describe_errors(err: ValidationError, top: str) -> list[str]:
    """One ``<field.path>: <message>`` line per problem of a settings model (``top`` names a
    problem of the whole document), pydantic's "Value error, " prefix dropped. The router's
    answer to a bad request body is another contract: ``router/request_schema.py``."""
    lines = []
    for e in err.errors():
        where = ".".join(str(part) for part in e["loc"]) or top
        lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return lines
