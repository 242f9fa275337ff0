"""The README and docs/: links resolve, the front page stays short and lists every page, and the
commands they quote name modules, files and options that exist (each CLI's --help is the
reference). Fast: no servers; each --help runs once."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 260

# `python -m X` for tools that are not this repository's modules.
KNOWN_TOOLS = {"pytest", "torch.distributed.run", "pip", "venv"}

# The CLIs whose options the docs quote: the spellings of a command, and its module.
CLIS = {
    "gspo_mcore.train": ("gspo-train", "gspo_mcore.train"),
    "gspo_mcore.evaluation.cli": ("gspo-eval", "gspo_mcore.evaluation.cli"),
    "gspo_mcore.planner.cli": ("gspo_mcore.planner.cli",),
    "checkpoint_convert": ("checkpoint_convert",),
    "gspo_mcore.engines.serve": ("gspo_mcore.engines.serve",),
    "gspo_mcore.rehearse": ("gspo_mcore.rehearse",),
}
CONVERT_SUBCOMMANDS = ("hf-to-mcore", "mcore-to-hf", "verify")


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def strip_code(text: str) -> str:
    """The text without fenced blocks and inline code (links in code are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`]*`", "", text)


def code_pieces(text: str) -> list[str]:
    """Every piece of code the text quotes: each logical line of a fenced block (a trailing `\\`
    joins the next line) and each inline span (which may wrap over lines)."""
    pieces = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        pieces += re.sub(r"\\\n", " ", block).splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    return pieces


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeats get -1, -2, ... as on GitHub)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(text: str) -> list[str]:
    """The targets of `[text](target)` and `![alt](target)` outside code."""
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", strip_code(text))


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Each relative link of a markdown file that does not resolve: a missing file, or an anchor
    that no heading of its file makes."""
    text = path.read_text() if text is None else text
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


def python_modules(piece: str) -> list[str]:
    """The modules a piece of code runs with `python -m` / `torchrun ... -m`."""
    return re.findall(r"(?:\bpython3?|\btorchrun\b[^`|;]*?)\s+-m\s+([A-Za-z_][\w.]*)", piece)


def is_repo_module(module: str) -> bool:
    """A module of this repository, or an old path kept for a release (common.deprecation.MOVED)."""
    from gspo_mcore.common.deprecation import new_home

    path = REPO.joinpath(*module.split("."))
    return (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
            or (path / "__init__.py").is_file() or (module.startswith("gspo_mcore.") and new_home(module) is not None))


def cli_invocations(piece: str) -> list[tuple[str, str, set[str]]]:
    """Each (CLI, checkpoint_convert's subcommand or "", the --options given) in a piece of code:
    the options up to the end of the piece, a shell separator or the next command."""
    spellings = {spelling: cli for cli, names in CLIS.items() for spelling in names}
    pattern = "|".join(re.escape(name) for name in sorted(spellings, key=len, reverse=True))
    found = []
    for match in re.finditer(rf"(?<![\w./-])(?:-m\s+)?({pattern})(?![\w.-])", piece):
        before = piece[:match.start()]
        spelled = match.group(1)
        if spelled not in ("gspo-train", "gspo-eval") and not re.search(r"(python3?|torchrun[^|;]*?)\s+$", before):
            continue  # a module named in prose (`gspo_mcore.planner.cli`), not run
        rest = re.split(r"\s(?:&&|\|\||;|\|)\s|#", piece[match.end():])[0]
        cli = spellings[spelled]
        subcommand = ""
        if cli == "checkpoint_convert":
            word = re.match(r"\s*([\w-]+)", rest)
            subcommand = word.group(1) if word and word.group(1) in CONVERT_SUBCOMMANDS else ""
        found.append((cli, subcommand, set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", rest))))
    return found


@functools.cache
def help_options(cli: str, subcommand: str = "") -> set[str]:
    """The options `python -m CLI [SUBCOMMAND] --help` lists."""
    done = subprocess.run([sys.executable, "-m", cli, *([subcommand] if subcommand else []), "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (cli, subcommand, done.stderr[-2000:])
    return set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", done.stdout))


# --- the helpers catch what they should (so that the checks below can fail) ---

def test_broken_links_are_found(tmp_path):
    (tmp_path / "b.md").write_text("# A page\n\n## Some heading: with `code`\n")
    page = tmp_path / "a.md"
    text = ("[ok](b.md) [ok](b.md#some-heading-with-code) [self](#top) ![img](missing.png)\n"
            "[gone](nothere.md) [bad anchor](b.md#no-such-heading) [web](https://example.com)\n"
            "# Top\n`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n")
    page.write_text(text)
    assert broken_links(page) == ["missing.png: no such file", "nothere.md: no such file",
                                  "b.md#no-such-heading: no heading #no-such-heading"]


def test_slugs_are_githubs():
    assert slug("Findings: GSPO on the engine's log-probs, bf16 engine, free router") == \
        "findings-gspo-on-the-engines-log-probs-bf16-engine-free-router"
    assert slug("GPU (8xH100)") == "gpu-8xh100"
    assert slug("The `rollout.mode` options") == "the-rolloutmode-options"


def test_commands_are_parsed():
    fence = "```bash\npython -m gspo_mcore.train --config c.yaml \\\n    --resume x=1\n```\n"
    pieces = code_pieces(fence + "and `gspo-eval --model M\n--urls U` then `python -m nosuch.module`")
    assert pieces == ["python -m gspo_mcore.train --config c.yaml      --resume x=1", "gspo-eval --model M --urls U",
                      "python -m nosuch.module"]
    assert cli_invocations(pieces[0]) == [("gspo_mcore.train", "", {"--config", "--resume"})]
    assert cli_invocations(pieces[1]) == [("gspo_mcore.evaluation.cli", "", {"--model", "--urls"})]
    assert cli_invocations("torchrun --nproc_per_node N -m gspo_mcore.train --config F  # --not-this") == \
        [("gspo_mcore.train", "", {"--config"})]
    assert cli_invocations("python -m checkpoint_convert verify --hf-dir A --mcore-dir B") == \
        [("checkpoint_convert", "verify", {"--hf-dir", "--mcore-dir"})]
    assert cli_invocations("the planner, `gspo_mcore.planner.cli` --shell") == []  # named, not run
    assert [python_modules(p) for p in pieces] == [["gspo_mcore.train"], [], ["nosuch.module"]]
    assert not is_repo_module("nosuch.module") and is_repo_module("gspo_mcore.train")
    assert is_repo_module("checkpoint_convert")


# --- the README and docs/ ---

@pytest.mark.parametrize("path", doc_files(), ids=lambda path: path.name)
def test_links_resolve(path):
    assert broken_links(path) == []


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README.read_text())}
    pages = sorted((REPO / "docs").glob("*.md"))
    assert pages and [page.name for page in pages if page.resolve() not in linked] == []


def test_numbered_pages_read_in_order():
    """Each numbered page starts with a title and a line saying what it is, and ends with a link to
    the next page (the last one back to the README)."""
    pages = sorted((REPO / "docs").glob("[0-9][0-9]-*.md"))
    assert len(pages) >= 10
    for page, following in zip(pages, [*pages[1:], README]):
        text = page.read_text().strip()
        assert text.startswith("# "), page.name
        assert re.match(r"# .+\n\n\S", text), page.name
        last = text.splitlines()[-1]
        assert links(last) and (page.parent / links(last)[-1]).resolve() == following.resolve(), (page.name, last)


@pytest.mark.slow  # runs each command's --help (the fast tier starts no CLI subprocess)
def test_quoted_modules_files_and_options_exist():
    problems = []
    invocations = set()
    for path in doc_files():
        text = path.read_text()
        for piece in code_pieces(text):
            for module in python_modules(piece):
                if module not in KNOWN_TOOLS and not is_repo_module(module):
                    problems.append(f"{path.name}: python -m {module}: no such module in this repository")
            for cli, subcommand, options in cli_invocations(piece):
                invocations.add((path.name, cli, subcommand, frozenset(options), piece.strip()[:100]))
        for name in sorted(set(re.findall(r"(?<![\w/.-])((?:configs|launch)/[\w/.-]*\w\.(?:yaml|json|sh|sbatch))", text))):
            if not (REPO / name).is_file():
                problems.append(f"{path.name}: {name}: no such file")
    assert {cli for _, cli, _, _, _ in invocations} >= {"gspo_mcore.train", "gspo_mcore.evaluation.cli", "gspo_mcore.planner.cli",
                                                         "checkpoint_convert"}
    for name, cli, subcommand, options, piece in sorted(invocations):
        unknown = set(options) - help_options(cli, subcommand)
        if unknown:
            problems.append(f"{name}: {piece}: {sorted(unknown)} not in `python -m {cli} {subcommand} --help`")
    assert problems == []


def test_the_data_page_examples_load(tmp_path):
    """docs/05-data-and-rewards.md: the JSONL records and the Parquet snippet are datasets."""
    from gspo_mcore.data import PromptDataset

    text = (REPO / "docs" / "05-data-and-rewards.md").read_text()
    jsonl = re.search(r"```jsonl\n(.*?)```", text, re.S).group(1)
    (tmp_path / "train.jsonl").write_text(jsonl)
    dataset = PromptDataset.load(tmp_path / "train.jsonl")
    assert [s.answer for s in dataset.samples] == ["2", "4"] and dataset[0].metadata == {"level": "Level 1"}
    assert dataset[1].messages[0]["role"] == "system" and dataset[1].prompt == "2+2?"
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "pq.write_table" in block)
    exec(snippet.replace('"train.parquet"', repr(str(tmp_path / "train.parquet"))), {})
    assert PromptDataset.load(tmp_path / "train.parquet")[0].metadata == {"source": "algebra"}
