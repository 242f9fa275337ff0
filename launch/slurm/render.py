"""Render an sbatch template: `python launch/slurm/render.py TEMPLATE KEY=VALUE ...` prints it
with every {{KEY}} replaced. NODES defaults to TRAINER_NODES + ROLLOUT_NODES. A missing or
unknown key is a one-line error (exit 2); nothing is printed then."""

import re
import shlex
import sys
from pathlib import Path

FIELD = re.compile(r"\{\{([A-Z_]+)\}\}")


def render(template: str, values: dict[str, str]) -> str:
    values = dict(values)
    if "TRAINER_NODES" in values and "NODES" not in values:
        values["NODES"] = str(int(values["TRAINER_NODES"]) + int(values.get("ROLLOUT_NODES", "0")))
    wanted = set(FIELD.findall(template))
    missing, unknown = sorted(wanted - set(values)), sorted(set(values) - wanted - {"NODES", "ROLLOUT_NODES"})
    if missing:
        raise ValueError(f"missing value for {missing[0]}")
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of this template")
    # Paths and config values are shell words; OVERRIDES is a list of key=value words.
    quoted = {k: (" ".join(shlex.quote(w) for w in v.split()) if k == "OVERRIDES" else shlex.quote(v))
              for k, v in values.items()}
    return FIELD.sub(lambda m: quoted[m.group(1)], template)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: render.py TEMPLATE KEY=VALUE ...", file=sys.stderr)
        return 2
    try:
        values = dict(arg.split("=", 1) for arg in argv[1:])
        print(render(Path(argv[0]).read_text(), values), end="")
    except (ValueError, OSError) as err:
        print(f"error: {argv[0]}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
