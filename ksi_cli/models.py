"""`ksi models`: the models this KSI can answer with.

The default model, the per-model settings, the built-in providers, the saved consortia (each is
the model alias `consortium/NAME`) and, on request, every model litellm's bundled price map
names. That map is read as a JSON file: the client never imports litellm.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from pathlib import Path
from typing import Any

import click

from ksi_cli.options import json_option, location_options
from ksi_cli.output import show, wants_json
from ksi_common import oneshot
from ksi_common.errors import KsiError
from ksi_common.events import CONSORTIUM_LIST, SYSTEM_CONFIG
from ksi_common.locate import Location, locate

BUILT_IN = {
    "echo/*": "built-in: answers from what it received (no network, no key)",
    "claude-cli/*": "the `claude` CLI, its session resumed per conversation",
    "gemini-cli/*": "the `gemini` CLI, its session resumed per conversation",
}


def litellm_models() -> list[str]:
    """Model names in litellm's bundled price and context-window map, without importing litellm."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        return []
    path = Path(spec.origin).parent / "model_prices_and_context_window_backup.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return sorted(name for name in known if name != "sample_spec")


def _settings(location: Location) -> tuple[dict[str, Any], bool]:
    try:
        return oneshot.request(location.socket, SYSTEM_CONFIG, timeout=2.0), True
    except KsiError:
        from ksi_common.settings import load_settings  # pydantic: only when no daemon answers

        return load_settings(var_dir=location.var_dir).public_view(), False


def _consortia(location: Location, running: bool) -> list[dict[str, Any]]:
    if running:
        try:
            return oneshot.request(location.socket, CONSORTIUM_LIST, timeout=5.0)["consortia"]
        except KsiError:
            pass
    found = []
    for path in sorted(location.layout.consortia_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        found.append({**record, "name": path.stem, "model": f"consortium/{path.stem}"})
    return found


@click.command()
@location_options
@json_option
@click.argument("pattern", required=False)
@click.option("--litellm", "with_litellm", is_flag=True, help="Also list every model litellm knows.")
def models(pattern: str | None, with_litellm: bool, as_json: bool, var_dir: str | None,
           socket_path: str | None) -> None:
    """List the default model, configured models, consortia and built-ins; PATTERN (a glob) filters litellm's."""
    location = locate(var_dir, socket_path)
    settings, running = _settings(location)
    known = litellm_models() if (with_litellm or pattern) else []
    if pattern:
        known = [name for name in known if fnmatch.fnmatchcase(name, pattern if "*" in pattern else f"*{pattern}*")]
    listing = {
        "default_model": settings.get("default_model"),
        "configured": settings.get("models") or {},
        "built_in": BUILT_IN,
        "consortia": {c["model"]: c.get("members", []) for c in _consortia(location, running)},
        "litellm": known,
        "litellm_count": len(litellm_models()) if not known else len(known),
    }
    if wants_json(as_json):
        show(listing, True)
        return
    click.secho(f"default: {listing['default_model']}  (KSI_DEFAULT_MODEL)", bold=True)
    click.secho("configured (KSI_MODELS):", bold=True)
    for name, options in listing["configured"].items():
        extras = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
        click.echo(f"  {name}  {extras}")
    if not listing["configured"]:
        click.echo("  none")
    click.secho("built in:", bold=True)
    for name, what in BUILT_IN.items():
        click.echo(f"  {name}  {what}")
    click.secho("consortia (aliases of their members):", bold=True)
    for name, members in listing["consortia"].items():
        click.echo(f"  {name}  {', '.join(map(str, members))}")
    if not listing["consortia"]:
        click.echo("  none; save one with: ksi send consortium:save --name NAME --members '[...]'")
    if known:
        click.secho("litellm knows:", bold=True)
        for name in known:
            click.echo(f"  {name}")
    else:
        click.echo(f"litellm knows {listing['litellm_count']} more models: ksi models --litellm, or ksi models PATTERN")
