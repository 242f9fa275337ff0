"""Section 7: the sync check (gspo_mcore.weight_sync.check_sync) of a push. In a child, a learner
takes one update at a learning rate that moves every weight and writes its weights as the disk
push does (save_hf_checkpoint); a stand-in server process answers vLLM 0.33's prompt log-probs
with `transformers` from that push and from the checkpoint before it (stale). Against the push
the median difference is within the config's tolerance; against the stale weights over 10x it."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import time

STAND_IN_SERVER = r"""
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import torch
from transformers import AutoModelForCausalLM
# A stand-in for vLLM 0.33's /v1/completions with prompt_logprobs (its answer's shape:
# entrypoints/openai/completion/protocol.py, vllm/logprobs.py Logprob: logprob, rank >= 1,
# decoded_token; None for the first token), one model per path prefix: /NAME/v1/completions.
device = sys.argv[1]
models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
          for name, path in (pair.split("=", 1) for pair in sys.argv[2:])}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        name, _, route = self.path.strip("/").partition("/")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if route != "v1/completions" or name not in models:
            self.send_error(404)
            return
        tokens = body["prompt"]
        with torch.no_grad():
            logits = models[name](input_ids=torch.tensor([tokens], device=device)).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1)
        chosen = logprobs.gather(1, torch.tensor(tokens[1:], device=device)[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        entries = [None] + [{str(t): {"logprob": lp, "rank": r, "decoded_token": None}}
                            for t, lp, r in zip(tokens[1:], chosen.tolist(), ranks.tolist())]
        data = json.dumps({"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

def exit_with_parent():  # stdin closes when the process that started us dies (even by SIGKILL)
    sys.stdin.read()
    os._exit(0)

threading.Thread(target=exit_with_parent, daemon=True).start()
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def section_7(check) -> dict:
    return check.child("gpucheck.sync_check:sync_check")


def sync_check(check) -> dict:
    from gpucheck.shape import check_config, make_inputs, update_once
    from gspo_mcore.megatron.checkpointing import save_hf_checkpoint
    from gspo_mcore.megatron.learner import Learner

    shape = check.shape
    hf_dir = make_inputs(check.work, shape)
    if shape.device == "cuda":  # a float32 learner and the server's two float32 models on one GPU: short sequences
        shape = copy.copy(shape)
        shape.sequences, shape.prompt, shape.response = 2, 32, 224
    # float32 on both sides (tolerance 0.01): the push's own noise is rounding, ~1e-5.
    config = check_config(check.work, shape, hf_dir, "float32", ["optimizer.cpu_offload=false", "optimizer.lr=0.01",
                                                                 "rollout.engine_dtype=float32"])
    learner = Learner(config)
    update_once(learner, shape, step=1)
    pushed = save_hf_checkpoint(learner.model, learner.arch, config.model.spec, check.work / f"pushed_{shape.device}",
                                hf_dir)
    server = subprocess.Popen([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", STAND_IN_SERVER,
                               shape.device, f"pushed={pushed}", f"stale={hf_dir}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        return compare_with_server(learner.model, shape, int(server.stdout.readline()), config.sync_check_tolerance)
    finally:
        server.kill()
        server.wait(60)


def compare_with_server(model, shape, port: int, tolerance: float) -> dict:
    from gpucheck.shape import synthetic_rollouts
    from gspo_mcore.engines.vllm.engine import VLLMEngine
    from gspo_mcore.weight_sync.check import check_sync

    rollouts, _ = synthetic_rollouts(shape, seed=7)
    probes = [r.prompt_ids + r.response_ids for r in rollouts[:2]]
    scored_from = [len(r.prompt_ids) for r in rollouts[:2]]
    began = time.perf_counter()
    stats = check_sync(model, VLLMEngine([f"http://127.0.0.1:{port}/pushed"]), probes, tolerance, scored_from)
    check_s = time.perf_counter() - began
    # The stale server's figures (an infinite tolerance: no refusal), to show the margin.
    stale = check_sync(model, VLLMEngine([f"http://127.0.0.1:{port}/stale"]), probes, math.inf, scored_from)
    return {**stats, "tolerance": tolerance, "check_s": check_s, "probe_tokens": [len(p) for p in probes],
            "stale_median": stale["sync_check_median"], "stale_within_0.1": stale["sync_check_within_0.1"],
            "stale_over_pushed": stale["sync_check_median"] / max(stats["sync_check_median"], 1e-12),
            # Within the tolerance against the push, and the stale weights 10x further: a random
            # model's log-probs are nearly flat (a trained one's stale differences reach ~1).
            "pass": stats["sync_check_median"] <= tolerance
                    and stale["sync_check_median"] > 10 * stats["sync_check_median"]}
