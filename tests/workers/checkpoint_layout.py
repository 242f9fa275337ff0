"""Checkpoints in the layout of the Checkpointer before parts registered with it (the code of
commit 6f0d9de, written out here) load into the registered parts, and a new save writes that
layout: `python tests/workers/checkpoint_layout.py HF_DIR OUT_DIR` (a world of one) prints `ok`.

That layout, OUTPUT_DIR/checkpoints/:
    latest                              the newest step's directory name
    step_NNNNNN/                        a torch_dist checkpoint with top-level keys `model`,
                                        `optimizer` (dp_reshardable), `rng_state` (one per rank)
    step_NNNNNN/trainer_state.json      {"step": N, "rollout": rank 0's rollout state,
                                         "lr_scheduler": the scheduler's state (absent before schedules)}
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint import FileSystemReader

from gspo_mcore.megatron.checkpointing import (LATEST, Checkpointer, FunctionState, MegatronState, SchedulerState,
                                      _init_optimizer_states, _rng_state, keep_writer_results_in_process)
from gspo_mcore.config import load_config
from gspo_mcore.megatron.qwen3_moe.bootstrap import model_from_config
from gspo_mcore.megatron.optimizer import lr_scheduler, setup_training

ROLLOUT = {"sampler": {"epoch": 1, "position": 48, "seed": 7, "num_samples": 64},
           "running": {"count": 3, "mean": 0.5, "m2": 0.25}}


def old_save(ddp, optimizer, scheduler, root: Path, step: int, with_schedule: bool = True) -> Path:
    """The Checkpointer's save at 6f0d9de, less the temporary directory and the retention."""
    _init_optimizer_states(optimizer, neutral=True)
    model_sd = ddp.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    sharded = {"model": model_sd,
               "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata),
               "rng_state": _rng_state()}
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    dist_checkpointing.save(sharded, str(path))
    state = {"step": step, "rollout": ROLLOUT, **({"lr_scheduler": scheduler.state_dict()} if with_schedule else {})}
    (path / "trainer_state.json").write_text(json.dumps(state))
    (root / LATEST).write_text(path.name)
    return path


def main(hf_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    config = load_config(None, [f"model.hf_dir={hf_dir}", "optimizer.lr=0.01", "optimizer.lr_warmup_steps=4",
                                "optimizer.lr_decay=linear", "train.steps=10"])
    _, model = model_from_config(config)
    ddp, optimizer = setup_training(model, config.optimizer)
    keep_writer_results_in_process()

    def checkpointer(output_dir: Path):
        """What the Trainer registers, with a fresh schedule; `got`: the rollout state loaded."""
        got = []
        scheduler = lr_scheduler(optimizer, config.optimizer, config.train.steps)
        checkpoints = Checkpointer(output_dir, ddp.module)
        checkpoints.register("model", MegatronState(ddp, optimizer))
        checkpoints.register("lr_scheduler", SchedulerState(scheduler, optimizer, checkpoints.train_state))
        checkpoints.register("rollout", FunctionState(lambda: ROLLOUT, got.append))
        return checkpoints, scheduler, got

    scheduler = lr_scheduler(optimizer, config.optimizer, config.train.steps)
    scheduler.step(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    saved = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    old = old_save(ddp, optimizer, scheduler, out / "old" / "checkpoints", 3)
    old_save(ddp, optimizer, scheduler, out / "before_schedules" / "checkpoints", 3, with_schedule=False)
    after_save = torch.rand(4)  # the saved RNG state's next draw

    for run in ("old", "before_schedules"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        checkpoints, fresh, got = checkpointer(out / run)
        assert checkpoints.load() == 3, run
        assert got == [ROLLOUT], run
        assert fresh.num_steps == 3 and fresh.get_lr(optimizer.param_groups[0]) == scheduler.get_lr(
            optimizer.param_groups[0]), run
        assert torch.equal(torch.rand(4), after_save), run
        now = model.state_dict()
        assert all(torch.equal(now[k], v) for k, v in saved.items()), run

    # A new save: the same files, the same keys, the same trainer_state.json.
    checkpoints, fresh, _ = checkpointer(out / "new")
    fresh.step(3)
    new = checkpoints.save(3)
    assert (out / "new" / "checkpoints" / LATEST).read_text() == "step_000003"
    assert json.loads((new / "trainer_state.json").read_text()) == json.loads((old / "trainer_state.json").read_text())
    keys = [set(FileSystemReader(str(p)).read_metadata().state_dict_metadata) for p in (old, new)]
    assert keys[0] == keys[1] and any(k.startswith("optimizer.") for k in keys[0]), keys[0] ^ keys[1]
    common = [torch.load(p / "common.pt", weights_only=False) for p in (old, new)]
    assert common[0].keys() == common[1].keys(), (common[0].keys(), common[1].keys())
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in new.iterdir())
    print("ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # the writer's Manager is spawned: it imports this file again
    main(sys.argv[1], sys.argv[2])
