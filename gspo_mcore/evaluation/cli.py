"""`gspo-eval`: a model on the config's `eval` datasets, through the config's engine.

    gspo-eval --config FILE --model DIR [--urls URL,...] [key=value ...]
    python -m gspo_mcore.evaluation.cli ...

DIR is a Hugging Face directory (config.json + safetensors), or a run's OUTPUT_DIR: its
exported hf/, else its latest checkpoint converted (checkpoint_convert mcore-to-hf, with
model.hf_dir's config.json and tokenizer). Without --urls the command starts `rollout.num_servers` servers for DIR
itself and stops them (their logs: --log-dir, a run's OUTPUT_DIR/logs/gspo-eval, else a new
directory under the system's temporary directory, named on stderr; never the current directory);
with --urls, running servers load DIR's weights first (Engine.load_from_disk: a file system both
see). The same chat template, reward workers and figures as the evaluation during training
(gspo_mcore.evaluation.held_out): on code, `reward: code_all` and `samples: k` give pass@1 as
code benchmarks report it (the mean over k samples per problem). Prints a markdown table, then
one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import yaml

from gspo_mcore.config import ConfigError, load_config
from gspo_mcore.data.tokenizer import load_tokenizer
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.evaluation.held_out import Evaluator
from gspo_mcore.megatron.checkpointing import checkpoint_step, latest_checkpoint
from gspo_mcore.megatron.qwen3_moe.hf_config import load_hf_config
from gspo_mcore import engines
from gspo_mcore.engines.capabilities import DiskLoad
from gspo_mcore.common.http import api_key_from_env


def model_dir(path: Path, scratch: Path | None = None, hf_config_dir: str | None = None) -> Path:
    """A Hugging Face directory: `path`, a run's exported `path`/hf, or its latest checkpoint
    converted into `scratch` (checkpoint_convert mcore-to-hf, with `hf_config_dir`'s config.json
    and tokenizer)."""
    if (path / "config.json").is_file():
        return path
    if (path / "hf" / "config.json").is_file():
        return path / "hf"
    if not (path / "checkpoints").is_dir():
        raise InputError(f"{path}: neither a Hugging Face model directory (config.json) nor a run's OUTPUT_DIR")
    if scratch is None or not hf_config_dir:
        raise InputError(f"{path}: a run without an exported hf/: give model.hf_dir (its config.json and tokenizer)")
    out = scratch / "hf"
    print(f"converting the latest checkpoint of {path} for the engine", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "checkpoint_convert", "mcore-to-hf", "--mcore-dir",
                           str(path / "checkpoints"), "--hf-config-dir", str(hf_config_dir), "--output-dir", str(out),
                           "--quiet"], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"mcore-to-hf failed ({done.returncode})"])[-1]
        raise InputError(last.removeprefix("error: "))  # the converter's own one line
    return out


def run_seeds(model: Path, hf_dir: Path, seed: int) -> tuple[int, str | None, str]:
    """The evaluation's seeds (eval_seed: the run's train.seed and the weights' version): for a
    run's model (its OUTPUT_DIR, or the hf/ in it), those of the run's last evaluation, which
    evaluated the weights its hf/ holds, so this prints that evaluation's figure; a latest
    checkpoint converted takes its own step's row. Otherwise `seed` (the config's) and no
    version. The third item says which, for the user."""
    run = model if (model / "eval.jsonl").is_file() else model.parent if (model.parent / "eval.jsonl").is_file() \
        and model.name == "hf" else None
    if run is None:
        return seed, None, f"train.seed {seed}, no weight version (not a run's model)"
    rows = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line.strip()]
    if hf_dir.parent != run:  # a latest checkpoint converted: the row of its step, if it was evaluated
        latest = checkpoint_step(latest_checkpoint(run))
        rows = [row for row in rows if row.get("step") == latest]
    saved = run / "config.yaml"
    if saved.is_file():
        seed = (yaml.safe_load(saved.read_text()) or {}).get("train", {}).get("seed", seed)
    if not rows:
        return seed, None, f"the run's train.seed {seed}; no evaluation of these weights in {run / 'eval.jsonl'}"
    last = rows[-1]
    return seed, last["version"], (f"the run's last evaluation of these weights: train.seed {seed}, weights "
                                   f"{last['version']} (step {last['step']}, {run / 'eval.jsonl'})")


def shares(figures: dict) -> str:
    """A dataset's shares of responses that were cut or held no program, those that are not 0
    ("-" when none is): a low pass@1 that says why."""
    said = [f"{label} {figures[key]:.0%}" for key, label in (("truncated_fraction", "truncated"),
                                                              ("no_program_fraction", "no program"))
            if figures.get(key)]
    return ", ".join(said) or "-"


def table(metrics: dict, names: list[str]) -> str:
    """One row per dataset: its prompts, samples per prompt (k), mean@k with its standard error
    over the prompts, pass@1, pass@k, pass@1..k, greedy, response length, time, reward errors, and
    the shares truncated or without a program where they are not 0."""
    lines = ["| dataset | prompts | k | mean@k ± s.e. | pass@1 | pass@k | pass@1..k | greedy | response length | "
             "time (s) | reward errors | truncated, no program |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        mine = {key.split("/")[-1]: v for key, v in metrics.items() if key.startswith(f"eval/{name}/")}
        k = max(int(key.split("@")[1]) for key in mine if key.startswith("pass@"))
        greedy = f"{mine['greedy']:.3f}" if "greedy" in mine else "-"
        every = " / ".join(f"{mine[f'pass@{j}']:.3f}" for j in range(1, k + 1))
        lines.append(f"| {name} | {mine['prompts']} | {k} | {mine[f'mean@{k}']:.3f} ± {mine[f'mean_se@{k}']:.3f} | "
                     f"{mine['pass@1']:.3f} | {mine[f'pass@{k}']:.3f} | {every} | {greedy} | "
                     f"{mine['response_length']:.1f} | {mine['time_s']:.1f} | {mine.get('reward_errors', 0)} | "
                     f"{shares(mine)} |")
    return "\n".join(lines)


def default_log_dir(model: Path) -> Path:
    """Where the servers gspo-eval starts keep their logs: a run's OUTPUT_DIR/logs/gspo-eval, else a
    new directory under the system's temporary directory (kept: a failed start is read there)."""
    if (model / "checkpoints").is_dir() or (model / "metrics.jsonl").is_file():
        return model / "logs" / "gspo-eval"
    return Path(tempfile.mkdtemp(prefix="gspo-eval-logs-"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gspo-eval", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, type=Path, help="a Hugging Face directory or a run's OUTPUT_DIR")
    parser.add_argument("--urls", default="", help="running engine servers, comma-separated (default: start them)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the started servers' logs (default: a run's OUTPUT_DIR/logs/gspo-eval, else a new "
                             "directory under the system's temporary directory)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gspo-eval-")))
        base = load_config(args.config, args.overrides)
        if args.urls:  # running servers load the weights from disk
            engines.engine_class(base.rollout.engine).require(DiskLoad, "gspo-eval --urls")
        hf_dir = model_dir(args.model.resolve(), scratch, base.model.hf_dir)
        seed, version, seeds = run_seeds(args.model.resolve(), hf_dir, base.train.seed)
        config = load_config(args.config, [*args.overrides, f"model.hf_dir={hf_dir}", f"train.seed={seed}"])
        print(f"gspo-eval: seeds of {seeds}", file=sys.stderr, flush=True)
        if not config.eval.datasets:
            raise ConfigError(f"eval.datasets: {args.config} names no dataset to evaluate on")
        tokenizer = load_tokenizer(config.data.tokenizer_dir or hf_dir)
        evaluator = Evaluator(config, tokenizer)
        stack.callback(evaluator.close)
        key = api_key_from_env()
        if args.urls:
            engine = engines.connect(config, [u for u in args.urls.split(",") if u], key)
            engine.load_from_disk(hf_dir, "eval")
        else:
            log_dir = args.log_dir or default_log_dir(args.model.resolve())
            print(f"gspo-eval: the servers' logs are in {log_dir}", file=sys.stderr, flush=True)
            engine = engines.connect(config, engines.start_servers(config, log_dir, stack, api_key=key), key)
        client = engine.client(load_hf_config(hf_dir / "config.json").vocab_size)
        metrics = evaluator.run(client, seeded_as=version)
    print(table(metrics, [d.name for d in config.eval.datasets]))
    print(json.dumps({"model": str(hf_dir), **metrics}), flush=True)
    return 0


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
