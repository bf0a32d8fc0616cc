"""``python -m serve_app.bench ...`` = ``serve-app bench ...`` (the streaming benchmark)."""

import typer

from serve_app.bench.cli import stream

typer.run(stream)
