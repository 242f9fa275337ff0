"""The one-GPU check's sections (launch/gpu_check.py is its command line), layered:

- `wheels`: the wheel folder on sys.path without pip; `lines`: the JSON line format and where lines
  go (stdout, --out's gpu_check.jsonl); `children`: a function run in a process of its own, a death
  there one FAIL line; `context.Check`: what a section sees; `shape`: the model, config, batch and
  hashes the sections share;
- one module per section (or group of them), each a function of the Check that returns its figures:
  `environment` (1), `parity` (2), `updates` (3), `resume` (4), `ipc_push` (5), `nccl_push` (6),
  `sync_check` (7), `host_adam` (8), `throughput` (9);
- `registry`: the sections in order with their time on one H100; `main`: the command line.

Nothing imports torch or megatron-core at module level: the parent of a CPU run and the tests of
these pieces stay light."""
