"""Starting a training run once its arguments and config are checked (gspo_mcore.run.cli): what a run would
otherwise find wrong only after building the model and starting servers is checked first (the
output directory, the resume point, the dataset, the reward, rollout and loss function names, the
code sandbox), the process environment is set for the device (`set_process_env`), then gspo_mcore.run.trainer's
`Trainer` runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_mcore.megatron.checkpointing import checkpoint_step, latest_checkpoint
from gspo_mcore.config import Config
from gspo_mcore.common.records import require_file
from gspo_mcore.engines import engine_class
from gspo_mcore.gspo.loss import load_loss_function
from gspo_mcore.rewards import load_reward_fn, reward_arguments
from gspo_mcore.rollout.functions import load_rollout_function
from gspo_mcore.run.torchrun import omp_threads
from gspo_mcore.tasks.toy import check_task_written
from gspo_mcore.run.trainer import Trainer
from gspo_mcore.sandbox.preflight import preflight

SANDBOXED_TOOLS = ("gspo_mcore.tools.python",)  # the tool modules that run the model's code


def check_inputs(config: Config, output_dir: Path, resume: bool) -> None:
    """What a run would otherwise find wrong only after building the model and starting servers
    (minutes on a 30B checkpoint): the checkpoint to resume, the loss function; on rank 0, which reads the data and
    scores, the dataset file and the reward and rollout function names (imported, signatures
    checked), and the code sandbox where a reward or tool runs model-written code (one trivial
    program through it). The same errors their users raise later."""
    if resume:
        check_not_finished(latest_checkpoint(output_dir), config.train.steps)
    engine_class(config.rollout.engine).check_config(config)
    load_loss_function(config.loss.function)  # every rank computes the loss
    if int(os.environ.get("RANK", 0)) != 0:
        return
    require_file(config.data.path)
    reward = config.reward
    reward_arguments(load_reward_fn(reward.name), reward.name, reward.url)
    load_rollout_function(config.rollout.function)
    users = sandbox_users(config)
    if users:  # rank 0 runs the reward and tool workers
        judges = any(not user.startswith("rollout.tools") for user in users)  # C++: the code rewards only
        preflight(", ".join(users), languages=config.reward.code.languages if judges else ())


def check_not_finished(checkpoint: Path, steps: int) -> None:
    """A resume of a run whose latest checkpoint is already at train.steps would start the
    servers, push the weights and train nothing: one line first, saying how to continue."""
    from gspo_mcore.common.errors import InputError

    done = checkpoint_step(checkpoint)
    if done >= steps:
        raise InputError(f"{checkpoint.parent.parent}: finished at step {done} of train.steps {steps}; raise "
                         f"train.steps (e.g. --resume train.steps={done + steps}) to continue")


def sandbox_users(config: Config) -> list[str]:
    """What in `config` runs model-written code in the sandbox (gspo_mcore.sandbox), as `field: name`:
    the code rewards (training's and each eval set's) and the python tool. A reward of yours that
    runs code in the sandbox says so with an attribute, `fn.runs_model_code = True`."""
    from gspo_mcore.rewards import code

    sandboxed = {load_reward_fn("code"), load_reward_fn("code_all"), code.code_reward, code.code_all_reward,
                 code.code_group_reward}
    rewards = [("reward.name", config.reward.name)] + [(f"eval.datasets[{i}].reward", d.reward)
                                                      for i, d in enumerate(config.eval.datasets) if d.reward]
    users = [f"{where}: {name}" for where, name in rewards
             if (fn := load_reward_fn(name)) in sandboxed or getattr(fn, "runs_model_code", False)]
    # By module, not imported: importing the python tool starts a sandbox (its own import-time check).
    users += [f"rollout.tools: {tool}" for tool in config.rollout.tools if tool.partition(":")[0] in SANDBOXED_TOOLS]
    return users


def set_process_env(config: Config) -> None:
    """OpenMP threads and NCCL's settings for this process, unless the caller set them."""
    if "OMP_NUM_THREADS" not in os.environ:
        # CPU runs share the cores with the engine's server; GPU ranks (CPU-offloaded Adam) take the node's
        # cores over its ranks. torch is imported already: set its pool too, not only the variable.
        threads = 1 if config.distributed.device == "cpu" else omp_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if config.distributed.device == "cuda" and config.weight_sync.method == "distributed":
        # SGLang runs with NCCL_CUMEM_ENABLE=0; members of one communicator that disagree on it
        # fail with "invalid argument". NCCL reads it once per process: set it before any group.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def run(config: Config, output_dir: Path, resume: bool, overwrite: bool, said: list[str]) -> None:
    """A run of `config` into `output_dir` (checked by gspo_mcore.run.cli.resolve), on this rank;
    `said`: what a resume changes, printed once."""
    check_task_written(config)
    set_process_env(config)
    check_inputs(config, output_dir, resume)
    if int(os.environ.get("RANK", 0)) == 0:
        for line in said:
            print(line, flush=True)
    Trainer(config, output_dir, resume, overwrite).run()
    dist.barrier()
    dist.destroy_process_group()
