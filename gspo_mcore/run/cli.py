"""`gspo-train`: the trainer's command line (`python -m gspo_mcore.train` is the same command).

    gspo-train --config FILE [--output-dir DIR] [--overwrite] [--print-config] [key=value ...]
    gspo-train --output-dir DIR --resume [--config FILE] [key=value ...]
    gspo-train --help-config    (every config key: type, default, meaning, whether --resume may change it)

The arguments, the output directory and the config (a typo, a bad value, a run already in
OUTPUT_DIR) are checked before Megatron and transformers are imported (seconds), so they answer
at once; gspo_mcore.run.start then checks the other inputs and runs the Trainer.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from pathlib import Path

from gspo_mcore.common.errors import run_cli


class HelpConfig(argparse.Action):
    """`--help-config`: like --help, answers at once whatever else the command line says."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from gspo_mcore.config.reference import listing

        sys.stdout.write(listing())
        parser.exit()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="gspo-train", description="GSPO training of a Qwen3-MoE on Megatron-Core")
    parser.add_argument("--help-config", action=HelpConfig,
                        help="list every config key with its type, default and meaning (docs/config_reference.md) "
                             "and exit")
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


def resolve(args):
    """(OUTPUT_DIR, the config, what a resume says it changes): refused here, not after the heavy imports.
    A resume trains with the run's own OUTPUT_DIR/config.yaml (its first command's overrides
    included) and this command's overrides on top (gspo_mcore.run.saved_config.resume_config)."""
    from gspo_mcore.run import saved_config
    from gspo_mcore.config import load_config
    from gspo_mcore.run.directory import check_output_dir, default_output_dir

    output_dir = Path(args.output_dir or default_output_dir(args.config))
    if not args.print_config:
        check_output_dir(output_dir, args.resume, args.overwrite)
    if args.resume:
        config, said = saved_config.resume_config(output_dir, args.config, args.overrides)
    else:
        config, said = load_config(args.config, args.overrides), []
    return output_dir, config, said


def main(argv=None) -> None:
    args = parse_args(argv)
    # The git revision in OUTPUT_DIR/config.yaml comes from `git status` (saved_config.provenance), which
    # refreshes the index and takes .git/index.lock in the user's checkout unless told not to.
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")
    output_dir, config, said = resolve(args)
    if args.print_config:  # nothing starts: loadable as is with --config
        from gspo_mcore.config import config_yaml

        print(config_yaml(config), end="", flush=True)
        return
    from gspo_mcore.megatron.checkpointing import hide_sharded_tensor_deprecation
    from gspo_mcore.run.start import run  # heavy (Megatron, transformers): only once the config is good

    hide_sharded_tensor_deprecation()
    run(config, output_dir, args.resume, args.overwrite, said)


STOPPED = {128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}  # stopped by a signal


def train_cli() -> None:
    try:
        code = run_cli(main)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed (gspo_mcore.run.preemption)
        print("SIGINT: stopped before training started", file=sys.stderr, flush=True)
        code = 128 + signal.SIGINT
    except SystemExit as stop:
        if stop.code not in STOPPED:
            raise
        # Stopped by a signal, with what the run started stopped and what it wrote closed on the way
        # out: the interpreter's own teardown (collecting the model's objects: seconds) is skipped,
        # not the exit handlers (wandb's temporary directories, imported by Megatron, are removed by them).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code)
    sys.exit(code)
