"""Every config key with its type, default and meaning, from gspo_mcore/config/schema.py itself:
the dataclasses give the keys, types, defaults and what a `--resume` may change (field metadata),
the string under each field (or under a group of fields) its meaning. One source for
docs/config_reference.md (a test checks the page is this module's output) and for
`gspo-train --help-config` (`listing`).

    python -m gspo_mcore.config.reference [--write]   (print the page, or rewrite docs/config_reference.md)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path

from gspo_mcore.config import Config
from gspo_mcore.common.files import atomic_output

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
HEADER = """# Config reference

*Every key of a run config, its type and default, generated from `gspo_mcore/config/schema.py`
(`python -m gspo_mcore.config.reference --write`; a test fails when this page is not its output;
`gspo-train --help-config` prints the same list). A YAML config sets them by section
(`train: {steps: 40}`), an override by dotted key (`train.steps=40`); `gspo-train --print-config`
shows a config with every default filled in. A key marked **resume** may change on `--resume`;
any other change refuses the resume.*
"""


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted: section.field
    type: str
    default: object
    doc: str
    resume: bool  # a `--resume` may change it (schema metadata RESUME)


def field_docs(cls) -> dict[str, str]:
    """{field: the string literal right after it}. A string after several fields is theirs
    together (clip_low, clip_high): it is shown for the last one, and the others point to it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs, pending = {}, []
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pending.append(node.target.id)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            *before, last = pending or [None]
            if last is not None:
                docs[last] = inspect.cleandoc(node.value.value)
            for name in before:
                docs[name] = f"(with `{last}`: see there)"
            pending = []
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def section_keys(cls, prefix: str) -> list[Key]:
    """`cls`'s fields as keys under `prefix`; a section inside a section (reward.code) as its own
    keys; a list of sections (eval.datasets) with its items' keys."""
    hints, docs, out = typing.get_type_hints(cls, vars(sys.modules[cls.__module__])), field_docs(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += section_keys(hints[f.name], f"{prefix}.{f.name}")
            continue
        annotation = inspect.get_annotations(cls)[f.name]
        shown = annotation if isinstance(annotation, str) else getattr(hints[f.name], "__name__", str(hints[f.name]))
        out.append(Key(f"{prefix}.{f.name}", shown, _default(f), docs.get(f.name, ""), bool(f.metadata.get("resume"))))
        item = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is list and item and dataclasses.is_dataclass(item[0]):
            out += section_keys(item[0], f"{prefix}.{f.name}[]")
    return out


def keys() -> list[Key]:
    """Every key of every section, in the order the schema declares them."""
    hints = typing.get_type_hints(Config)
    return [key for section in dataclasses.fields(Config) for key in section_keys(hints[section.name], section.name)]


def _yaml_value(value) -> str:
    import yaml

    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def page() -> str:
    """The Markdown page: a table per section."""
    lines, section = [HEADER.rstrip()], None
    for key in keys():
        name = key.name.split(".", 1)[0]
        if name != section:
            section = name
            lines += ["", f"## {section}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        doc = ("**resume.** " if key.resume else "") + " ".join(key.doc.split()).replace("|", "\\|")
        kind = key.type.replace("|", "\\|")
        lines.append(f"| `{key.name}` | `{kind}` | `{_yaml_value(key.default)}` | {doc} |")
    return "\n".join(lines) + "\n"


def listing(width: int = 100) -> str:
    """Plain text for a terminal: each key, its type and default (and whether a resume may change
    it), then its meaning indented."""
    lines = []
    for key in keys():
        lines.append(f"{key.name} ({key.type}, default {_yaml_value(key.default)}{', resume' if key.resume else ''})")
        if key.doc:
            lines += textwrap.wrap(" ".join(key.doc.split()), width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.config.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(PAGE.parent.parent)}")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(page())
        return 0
    with atomic_output(PAGE) as tmp:
        tmp.write_text(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
