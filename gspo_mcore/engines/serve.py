"""`python -m gspo_mcore.engines.serve --config FILE --port P [--host H] [key=value ...]`: the engine
server a run config describes (rollout.engine) (the launch scripts' way to start one), its output on ours with
the API key redacted (engines log their arguments). SIGTERM / SIGINT stop it and its workers."""

from __future__ import annotations

import argparse
import signal
import sys

from gspo_mcore.config import load_config
from gspo_mcore.common.errors import InputError, run_cli
from gspo_mcore.common.processes import start_redacted
from gspo_mcore.common.http import API_KEY_ENV, api_key_from_env
from gspo_mcore.engines import engine_class

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo_mcore.engines.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to listen on (default: %(default)s, this host only); 0.0.0.0 serves other "
                             f"hosts: then {API_KEY_ENV} must hold the run's API key")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    key = api_key_from_env()
    if args.host not in LOOPBACK and not key:
        raise InputError(f"--host {args.host}: a server other hosts can reach needs an API key in {API_KEY_ENV} "
                         "(anyone reaching it could load weights into it)")
    config = load_config(args.config, args.overrides)
    cmd, env = engine_class(config.rollout.engine).launch_command(config, args.port, args.host, api_key=key)
    # In our process group: the launch scripts' teardown signals the group, the engine included.
    server = start_redacted(cmd, sys.stdout.buffer, (key,), env)

    def stop(signum, frame):  # the engine's launcher takes its workers down on SIGTERM
        server.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return server.wait()


if __name__ == "__main__":
    sys.exit(run_cli(main))
