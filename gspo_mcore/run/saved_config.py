"""A run's resolved config, kept in OUTPUT_DIR/config.yaml, and what `--resume` may change.

The file is the config the run trains with (every field, defaults included, loadable again with
`--config`), headed by the package version and the git revision of the code. On `--resume` the
new config is compared with it field by field: a field the schema marks as one a resume may change
(`metadata=RESUME` in gspo_mcore.config.schema: the learning rate and its schedule, the step count,
the save cadence, where the servers are, timeouts) takes its new value, said in one line; any
other changed field (the model, the data, the sampling, the loss, the batch shape, the layout:
what changes the model or the data order) refuses the resume in one line naming the fields.
"""

from __future__ import annotations

import dataclasses
import subprocess
from importlib import metadata
from pathlib import Path

import yaml

from gspo_mcore.config import LEVEL_FUNCTIONS, Config, ConfigError, config_yaml, from_dict, load_config, resume_fields
from gspo_mcore.common.files import atomic_output

FILE = "config.yaml"
# The fields a resume applies: those the schema marks `metadata=RESUME`.
APPLIED_ON_RESUME = resume_fields()


def flat(config: Config) -> dict:
    """{"section.field": value} of every field."""
    return {f"{section}.{key}": value for section, fields in dataclasses.asdict(config).items()
            for key, value in fields.items()}


def provenance() -> str:
    """The package version, and the git revision of the code when it is a checkout (+ "-dirty")."""
    try:
        version = metadata.version("gspo-mcore")
    except metadata.PackageNotFoundError:
        version = "unknown"
    repo = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = dirty = ""
    return f"gspo-mcore {version}" + (f", git {rev}{'-dirty' if dirty else ''}" if rev else "")


def save(config: Config, output_dir: Path) -> Path:
    path = Path(output_dir) / FILE
    text = (f"# The resolved config of this run ({provenance()}); `--resume` compares against it.\n"
            + config_yaml(config))
    with atomic_output(path) as tmp:
        tmp.write_text(text)
    return path


def upgrade(saved: dict) -> dict:
    """A saved config of an older version with its replaced fields as the fields that replaced them
    (loss.level -> loss.function), so its runs still resume."""
    loss = saved.get("loss")
    if not isinstance(loss, dict) or "level" not in loss or "function" in loss:
        return saved
    function = LEVEL_FUNCTIONS.get(loss["level"], loss["level"])
    return {**saved, "loss": {**{k: v for k, v in loss.items() if k != "level"}, "function": function}}


def check_resume(config: Config, output_dir: Path) -> str | None:
    """The line that says which changed fields a resume applies (None: nothing changed, or no
    saved config to compare with); ConfigError naming the fields it cannot take."""
    path = Path(output_dir) / FILE
    if not path.is_file():
        return None
    try:
        saved = flat(from_dict(Config, upgrade(yaml.safe_load(path.read_text()) or {})))
    except (ConfigError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not a config this version reads ({err})") from None
    new = flat(config)
    changed = [key for key in new if new[key] != saved.get(key)]
    refused = [key for key in changed if key not in APPLIED_ON_RESUME]
    if refused:
        raise ConfigError(
            f"--resume: {', '.join(f'{k} ({saved.get(k)!r} -> {new[k]!r})' for k in refused)} differ from {path}: "
            "they change the model or the data order; start a new run (another --output-dir, or --overwrite), "
            "or edit that file if you mean it")
    if not changed:
        return None
    return "resume: applying " + ", ".join(f"{k} {saved.get(k)!r} -> {new[k]!r}" for k in changed)


def resume_config(output_dir: Path, config_path: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config a `--resume` trains with: the run's own OUTPUT_DIR/config.yaml (the first run's
    overrides included) with this command's overrides on top, checked by `check_resume`; and the
    lines to print. `config_path` (optional): a field where that file disagrees with the run's
    config keeps the run's value, said in one line (the run's config is the truth of the run: a
    change is an override); without a saved config (a run from before config.yaml), that file is
    the config, as before."""
    saved = Path(output_dir) / FILE
    if not saved.is_file():
        if config_path is None:
            raise ConfigError(f"--resume: {saved} not found: give --config (the run's config)")
        config = load_config(config_path, overrides)
        applied = check_resume(config, output_dir)
        return config, [applied] if applied else []
    try:
        data = upgrade(yaml.safe_load(saved.read_text()) or {})
    except yaml.YAMLError as err:
        raise ConfigError(f"{saved}: not valid YAML ({str(err).splitlines()[0]})") from None
    config = load_config(overrides=overrides, data=data)
    applied = check_resume(config, output_dir)
    lines = [applied] if applied else []
    if config_path is not None:
        theirs, ours = flat(load_config(config_path, overrides)), flat(config)
        kept = [key for key in ours if theirs[key] != ours[key]]
        if kept:
            lines.append(f"resume: the run's {saved} is the config; kept over {config_path}: "
                         + ", ".join(f"{k} {ours[k]!r} (not {theirs[k]!r})" for k in kept)
                         + "; pass key=value to change one")
    return config, lines
