"""``regions`` commands: render the files generated from ``regions/``, or check they are current.

    python -m serve_app.regions.cli render   # writes configs/<id>.yaml and terraform/ files
    python -m serve_app.regions.cli check    # exit 1 and list every drifted, missing or stale file
    python -m serve_app.regions.cli list     # one line per region

``app`` is a Typer app, meant to be mounted in the main CLI as ``serve-app regions``.
"""

from pathlib import Path

import typer
import yaml

from serve_app.regions import layout
from serve_app.regions import render as region_render
from serve_app.regions import schema as regions_mod
from serve_app.paths import REPO_ROOT

app = typer.Typer(help="Regions: regions/<id>.yaml -> Serve configs and Terraform.", no_args_is_help=True)

RepoOption = typer.Option(REPO_ROOT, "--repo", help="Repository root (holds regions/, configs/, terraform/).")


def _load(repo: Path) -> dict[str, regions_mod.Region]:
    try:
        return regions_mod.load_regions(repo / "regions")
    except regions_mod.RegionError as err:
        typer.echo(f"invalid regions:\n{err}", err=True)
        raise typer.Exit(2) from None


def _render(repo: Path) -> dict[str, str]:
    regions = _load(repo)
    try:
        return region_render.rendered_files(regions, repo)
    except regions_mod.RegionError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


def drift(repo: Path) -> list[str]:
    """Problems between the working tree and a fresh rendering, one line each (empty: current)."""
    expected = _render(repo)
    problems = []
    for rel, text in expected.items():
        path = repo / rel
        if not path.exists():
            problems.append(f"missing: {rel}")
        elif path.read_text() != text:
            problems.append(f"drifted: {rel}")
    for rel in sorted(region_render.generated_files_on_disk(repo) - set(expected)):
        problems.append(f"stale (no region file renders it): {rel}")
    for path in sorted((repo / "configs").glob("*.yaml")):  # hand-made ones too: the split holds
        problems += [f"{path.relative_to(repo)}: {p}" for p in layout.problems(yaml.safe_load(path.read_text()))]
    return problems


@app.command()
def render(repo: Path = RepoOption) -> None:
    """Write every generated file; remove generated files of regions that no longer exist."""
    expected = _render(repo)
    for rel in sorted(region_render.generated_files_on_disk(repo) - set(expected)):
        (repo / rel).unlink()
        typer.echo(f"removed {rel}")
        try:
            (repo / rel).parent.rmdir()  # only when empty
        except OSError:
            pass
    for rel, text in expected.items():
        path = repo / rel
        if path.exists() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        typer.echo(f"wrote {rel}")


@app.command()
def check(repo: Path = RepoOption) -> None:
    """Exit 1 when a committed generated file differs from its rendering."""
    problems = drift(repo)
    if problems:
        typer.echo("\n".join(problems), err=True)
        typer.echo(f"run `{region_render.RENDER_COMMAND}` and commit the result", err=True)
        raise typer.Exit(1)
    typer.echo("regions: every generated file is current")


@app.command("list")
def list_regions(repo: Path = RepoOption) -> None:
    """One line per region: id, status, GPUs, models, peers."""
    for region in _load(repo).values():
        models = ", ".join(f"{m.id} {m.replicas.min}..{m.replicas.max}" for m in region.models)
        status = f"{region.status} (draining)" if region.draining else region.status
        typer.echo(
            f"{region.id}  {status:<5}  {region.gpu.count} x {region.gpu.accelerator_type:<12}  "
            f"{region.location}  [{models}]  peers: {', '.join(region.peers) or '-'}"
        )


if __name__ == "__main__":
    app()
