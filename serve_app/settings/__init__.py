"""The one base of every configuration model: the app's args (``serve_app.config``), auth,
telemetry and the region files. Unknown keys are errors, named with their path, so a typo fails
the deploy instead of being ignored. (Request bodies are not settings: ``router/strict.py``.)"""

from pydantic import BaseModel, ConfigDict


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FrozenSettings(Settings):
    """Settings read as facts, never changed after loading (the region files)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
