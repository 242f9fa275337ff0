"""The command line (launch/gpu_check.py): the wheel folder on the path, then each section chosen,
one JSON line each (gpucheck.lines); exit status 1 when any failed. With --child, the body of a
child process (gpucheck.children)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from gpucheck.children import MODES
from gpucheck.context import Check, run_in_child
from gpucheck.lines import Lines, budget_line, error_figures, section_line
from gpucheck.registry import BY_NUMBER, ORDER, SECTIONS
from gpucheck.shape import REPO
from gpucheck.wheels import use_wheels

WHEELS = REPO / "launch" / "wheels"  # launch/wheelhouse.sh's default folder


def parser() -> argparse.ArgumentParser:
    sections = "; ".join(f"{s.number}. {s.name} (~{s.estimate_s} s)" for s in SECTIONS)
    p = argparse.ArgumentParser(prog="python launch/gpu_check.py", description=f"The one-GPU check: {sections}")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="launch/wheelhouse.sh's folder (default %(default)s)")
    p.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="the synthetic checkpoint and the "
                   "save of section 4 (~30 GB on CUDA; default %(default)s)")
    p.add_argument("--only", type=int, action="append", choices=sorted(BY_NUMBER),
                   help="run this section (repeatable, in the order given; default: all, in the order "
                   f"{', '.join(map(str, ORDER))})")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="start a section only if its estimate fits "
                   "what is left of SECONDS, cap each child's timeout at what is left, and end with a line naming "
                   "what was left out")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees one")
    p.add_argument("--out", type=Path, help="also append each line to OUT/gpu_check.jsonl as it is made "
                   "(section 8 writes OUT/host_adam.json for the planner's --host-adam)")
    p.add_argument("--children", choices=MODES, help="how a section's child process starts (default: spawn on "
                   "CUDA, forkserver on CPU; gpucheck/children.py)")
    p.add_argument("--child-timeout", type=float, default=900.0, help="seconds a child may run (default %(default)s)")
    # A child process of the check (gpucheck.children.spawn): MODULE:FUNCTION, its JSON keyword
    # arguments, the file its figures go to.
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def device_of(requested: str | None) -> str:
    """cuda or cpu; "cuda" asked for where torch sees none is one line, exit 2."""
    if requested == "cpu":
        return "cpu"  # without importing torch: the parent of a CPU run needs it only in section 1
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: torch sees no CUDA device")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    wheels = use_wheels(args.wheels)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.child:
        common = {"device": args.device, "work": str(args.work), "wheels": str(args.wheels),
                  "children": args.children or "spawn"}
        run_in_child(args.child, json.loads(args.child_args), common, args.result)
        return 0
    device = device_of(args.device)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    lines = Lines(time.strftime("%Y-%m-%dT%H:%M:%S"), args.out.resolve() if args.out else None)
    check = Check(device=device, work=args.work, wheels=args.wheels.resolve(), lines=lines, wheel_paths=len(wheels),
                  children=args.children or ("spawn" if device == "cuda" else "forkserver"),
                  child_timeout_s=args.child_timeout)
    failed, ran, left_out = False, [], []
    began = time.perf_counter()
    for number in args.only or ORDER:
        if args.budget is not None:
            left = args.budget - (time.perf_counter() - began)
            if BY_NUMBER[number].estimate_s > left:
                left_out.append(number)
                continue
            check.child_timeout_s = min(args.child_timeout, left)
        failed |= run_section(check, number)["result"] == "FAIL"
        ran.append(number)
    if args.budget is not None:
        lines.emit(budget_line(args.budget, time.perf_counter() - began, ran,
                               [(n, BY_NUMBER[n].name, BY_NUMBER[n].estimate_s) for n in left_out]))
    return 1 if failed else 0


def run_section(check: Check, number: int) -> dict:
    """Section `number` to its line, out at once: what it raised is its FAIL, and the next runs."""
    section = BY_NUMBER[number]
    began = time.perf_counter()
    try:
        figures = section.run(check)
    except Exception as err:  # noqa: BLE001 (a section's failure is its verdict; the next one runs)
        traceback.print_exc(file=sys.stderr)
        figures = error_figures(err)
    return check.lines.emit(section_line(number, section.name, check.device, time.perf_counter() - began, figures))
