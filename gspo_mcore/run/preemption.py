"""Stopping a run on a signal without losing steps: SIGTERM, SIGUSR1 (Slurm's time-limit warning,
`sbatch --signal=B:USR1@SECONDS`) and SIGINT (Ctrl-C).

The first signal makes the run save the last completed step and exit with 128 + the signal's
number, whatever `train.save_every` says: a step in its rollout is abandoned (the requests in
flight are aborted on the servers: generation is most of a step on GPUs, and what it produced is
lost anyway), a step in its update or push finishes first (its weights are half-updated until
then). The ranks agree: rank 0 abandons a rollout by broadcasting "stop" instead of a batch, and
after each step every rank learns whether any rank was signalled (one all-reduce on the host
group). While the run starts (servers, weights) or finishes (export), and on a second signal
(another one, or the same one again: `duplicate_window_s`), the run stops at once: it unwinds,
killing the servers it started instead of draining them. Reward and tool workers and servers
run in sessions of their own: a terminal's Ctrl-C reaches the trainer only, which stops them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from gspo_mcore.megatron.parallel import host_group
from gspo_mcore.common.processes import stop_at_once

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def duplicate_window_s(environ=os.environ) -> float:
    """Under torchrun a rank gets Ctrl-C's SIGINT from the terminal and again from torchrun (which
    hands what it got to its workers at once), and Slurm's SIGTERM from slurmstepd and again from
    torchrun: the same signal within this many seconds is one. A process on its own gets each
    signal once, and a second Ctrl-C, however soon, means "stop now"."""
    return 1.0 if "TORCHELASTIC_RUN_ID" in environ else 0.0


class Preempted(BaseException):
    """Raised in the main thread to abandon a rollout (BaseException: no `except Exception` keeps it)."""


class StopRequest:
    """Installed once per process. `phase` is "rollout" (rank 0 generating: abandon it), "step"
    (finish it first) or None (starting or finishing: stop at once)."""

    def __init__(self, on_abandon=None):
        self.signum: int | None = None
        self.since = 0.0
        self.phase: str | None = None
        self.said_stopping = False  # "stopping now" is printed once, however many signals follow
        self.on_abandon = on_abandon  # rank 0: aborts the requests in flight, so the rollout's threads return
        self.duplicate_s = duplicate_window_s()
        self.lost: BaseException | None = None  # raised inside a finalizer, where Python drops it: raised again
        self.pid = os.getpid()
        self._next_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for sig in SIGNALS:
            signal.signal(sig, self._handler)

    def _unraisable(self, unraisable) -> None:
        """What the handler raised inside a `__del__` or a weakref callback (the signal came while
        the garbage collector ran one) Python prints as "Exception ignored" and drops: a second
        Ctrl-C was lost so, and the save went on. It is raised again a moment later, outside it."""
        if not isinstance(unraisable.exc_value, (SystemExit, Preempted)):
            return self._next_hook(unraisable)
        self.lost = lost = unraisable.exc_value
        signum = lost.code - 128 if isinstance(lost, SystemExit) else lost.args[0]
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()

    def _handler(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # A process forked from this one (Megatron's checkpoint writers, during the save) got the
            # group's Ctrl-C: it dies of it as it would without this handler, saying nothing (it
            # said "stopping now" too, once for each writer).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.lost is not None:
            lost, self.lost = self.lost, None
            raise type(lost)(*lost.args)
        name = signal.Signals(signum).name
        if signum == self.signum and time.monotonic() - self.since < self.duplicate_s:
            return  # the same signal twice at once: the terminal's and torchrun's, or Slurm's and torchrun's
        if self.signum is not None or self.phase is None:
            said, self.said_stopping = self.said_stopping, True
            if not said and (dist.is_initialized() and dist.get_rank() == 0 or not dist.is_initialized()):
                print(f"{name}: stopping now", file=sys.stderr, flush=True)
            stop_at_once()  # the servers this run started are killed on the way out, not drained
            raise SystemExit(128 + signum)
        self.signum, self.since = signum, time.monotonic()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{name}: saving the last completed step, then stopping ({name} again: stop at once)",
                  file=sys.stderr, flush=True)
        if self.phase == "rollout":
            if self.on_abandon is not None:
                self.on_abandon()
            raise Preempted(signum)

    def requested_anywhere(self) -> int:
        """The signal any rank got (0: none), on every rank. Collective (host group, gloo)."""
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)  # host: a gloo collective
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        return int(flag.item())
