"""python -m checkpoint_convert {hf-to-mcore, mcore-to-hf, verify} ..."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings

from gspo_mcore.common.errors import run_cli


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoint_convert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core torch_dist")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--output-dir", required=True)
    to_mcore.add_argument("--dtype", choices=["bf16", "fp32"], help="cast weights (default: as stored)")
    to_mcore.add_argument(
        "--spec", choices=["te", "local"], default="te",
        help="module set the checkpoint is for; both read the same keys (see README), so the output is identical",
    )
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron-Core torch_dist -> HF safetensors")
    to_hf.add_argument("--mcore-dir", required=True)
    to_hf.add_argument("--hf-config-dir", required=True, help="config.json and tokenizer files to copy")
    to_hf.add_argument("--output-dir", required=True)
    check = sub.add_parser("verify", help="compare logits and weights of an HF and an MCore checkpoint")
    check.add_argument("--hf-dir", required=True)
    check.add_argument("--mcore-dir", required=True)
    for p in (to_mcore, to_hf):
        p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    for p in (to_mcore, to_hf, check):
        p.add_argument("--quiet", action="store_true", help="no progress bar, no library warnings")
    args = parser.parse_args()
    if args.quiet:  # the result (and errors) still print; Megatron's and torch's chatter does not

        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")

    from checkpoint_convert import convert  # after the filters above: importing Megatron warns
    from gspo_mcore.megatron.checkpointing import hide_sharded_tensor_deprecation

    hide_sharded_tensor_deprecation()

    if args.command == "hf-to-mcore":
        convert.hf_to_mcore(args.hf_dir, args.output_dir, args.dtype, args.overwrite, args.quiet)
    elif args.command == "mcore-to-hf":
        convert.mcore_to_hf(args.mcore_dir, args.hf_config_dir, args.output_dir, args.overwrite, args.quiet)
    else:
        from checkpoint_convert.verify import verify

        figures = verify(args.hf_dir, args.mcore_dir)
        print(json.dumps(figures), flush=True)
        if not figures["ok"]:
            print(f"verify: above tolerance {figures['tolerance']} (or weights differ)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
