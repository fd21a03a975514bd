"""``controllerctl serve``: run the sidecar until SIGTERM or SIGINT, then snapshot and exit 0.

On start it logs where it listens and writes ``<state_dir>/endpoints.json`` with the bound
addresses (ephemeral ports resolved), which scripts and tests read instead of guessing ports.
``--record-steps FILE`` appends every applied engine step to FILE (``sim.steplog``'s format) for
``controllerctl profile fit``; a failed write stops the recording, never the sidecar.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from controller.config import ConfigError, SidecarConfig, load_config
from controller.sidecar import Sidecar
from controller.snapshot import write_json_atomic
from policies.spec import PolicyError

log = logging.getLogger("controller.serve")


async def serve(config: SidecarConfig, *, record_steps: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT; the final snapshot is written on the way out."""
    from sim.steplog import StepRecorder

    sidecar = Sidecar(config=config)
    recorder = StepRecorder(path=record_steps) if record_steps is not None else None
    sidecar.step_sink = recorder
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await sidecar.start()
    endpoints = config.endpoints_path
    try:
        write_json_atomic(
            endpoints,
            {
                "engine": sidecar.engine_target,
                "admin": sidecar.admin_target,
                "metrics": sidecar.metrics_url,
                "pid": os.getpid(),
            },
        )
        log.info(
            "sidecar listening: engines on %s, admin on %s, metrics %s; state in %s",
            sidecar.engine_target,
            sidecar.admin_target,
            sidecar.metrics_url or "disabled",
            config.state_dir,
        )
        await stop.wait()
        log.info("stopping: writing the final snapshot")
    finally:
        await sidecar.stop(snapshot=True)
        if recorder is not None:
            recorder.close()
            log.info("recorded %d steps in %s", recorder.steps, recorder.path)
        with contextlib.suppress(OSError):
            endpoints.unlink()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="controllerctl serve", description="Run the speculation-control sidecar."
    )
    parser.add_argument("--config", metavar="FILE", help="sidecar YAML config (defaults serve without one)")
    parser.add_argument(
        "--record-steps", metavar="FILE", help="append applied engine steps to FILE (for profile fit)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config, record_steps=Path(args.record_steps) if args.record_steps else None))
    except PolicyError as e:
        print(f"error: default_policy: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found at bind time (a socket path naming something else)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the state dir held by another sidecar, a port taken, ...
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
