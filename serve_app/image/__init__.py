"""The GPU image's tools: its lock resolved from pyproject.toml (``image_lock``) and an
operator's first check on a GPU node (``gpu_smoke``, ``gpu_smoke_checks``)."""
