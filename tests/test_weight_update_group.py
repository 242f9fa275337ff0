"""The trainer's end of the weight-push group (gspo_mcore.engines.sglang.process_group) against
SGLang's own `init_custom_process_group`, as a server's TP worker calls it: one group, a tensor
broadcast from the trainer arrives; the trainer's process never imports SGLang (3.2 s of CPU
in every run's rank 0 when it did)."""

import subprocess
import sys

import pytest

from helpers import REPO, environment

TRAINER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from gspo_mcore.common.netaddr import listening_store
from gspo_mcore.engines.sglang.engine import SGLangEngine  # noqa: F401  (the module the trainer loads)
from gspo_mcore.engines.sglang.process_group import weight_update_group

store = listening_store("127.0.0.1", 2, timedelta(seconds=60))
print(store.port, flush=True)
group = weight_update_group("gloo", dist.PrefixStore("push", store), 2, 0, "push", timedelta(seconds=60))
dist.broadcast(torch.arange(5.0), group_src=0, group=group)
dist.barrier(group=group)
print("sglang" in sys.modules, flush=True)
"""

SERVER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from sglang.srt.utils import init_custom_process_group

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=60))
group = init_custom_process_group(backend="gloo", store=dist.PrefixStore("push", store), world_size=2, rank=1,
                                  group_name="push", timeout=timedelta(seconds=60))
got = torch.zeros(5)
dist.broadcast(got, group_src=0, group=group)
dist.barrier(group=group)
print(got.tolist(), flush=True)
"""


@pytest.mark.slow  # two processes, one importing SGLang
def test_the_trainers_group_meets_sglangs_own_and_imports_no_sglang():
    env = environment()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        port = trainer.stdout.readline().strip()
        server = subprocess.run([sys.executable, "-c", SERVER, port], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120)
        out, err = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert server.returncode == 0, server.stderr[-2000:]
    assert trainer.returncode == 0, err[-2000:]
    assert server.stdout.strip().splitlines()[-1] == "[0.0, 1.0, 2.0, 3.0, 4.0]"
    assert out.strip() == "False"
