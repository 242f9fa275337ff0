"""`gspo-train`: the trainer's command line (`python -m gspo_mcore.train` is the same command).

    gspo-train --config FILE [--output-dir DIR] [--overwrite] [--print-config] [key=value ...]
    gspo-train --output-dir DIR --resume [--config FILE] [key=value ...]

The arguments are parsed before anything heavy is imported, so `--help` and a usage error
answer at once; gspo_mcore.start then checks the inputs and runs the Trainer.
"""

from __future__ import annotations

import argparse
import sys

from gspo_mcore.errors import run_cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="gspo-train", description="GSPO training of a Qwen3-MoE on Megatron-Core")
    parser.add_argument("--config", help="the run config (YAML); with --resume, optional: OUTPUT_DIR/config.yaml")
    parser.add_argument("--output-dir", default=None, help="default: runs/<config name>")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUTPUT_DIR's last checkpoint, with OUTPUT_DIR/config.yaml and these overrides")
    parser.add_argument("--overwrite", action="store_true", help="replace the run OUTPUT_DIR holds")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML (base merged, overrides applied) and exit")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)
    if args.config is None and not args.resume:
        parser.error("--config is required (without --resume)")
    if args.config is None and args.output_dir is None:
        parser.error("--resume without --config needs --output-dir (the run to continue)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from gspo_mcore.start import run  # heavy (torch, Megatron, transformers): only once the arguments are good

    run(args)


def train_cli() -> None:
    sys.exit(run_cli(main))
