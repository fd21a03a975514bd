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
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

from controller.config import SidecarConfig, load_config
from controller.errors import ConfigError
from controller.server import SidecarServer
from controller.snapshot import write_json_atomic
from controller.state_dir import LOCK_NAME, SocketInUse, StateDirLocked, tcp_address_taken
from controller.wire.address import parse_address
from policies.spec import PolicyError
from sim.files import output_problem, same_file

log = logging.getLogger("controller.serve")


async def serve(config: SidecarConfig, *, record_steps: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT; the final snapshot is written on the way out."""
    from sim.steplog import StepRecorder

    sidecar = SidecarServer(config=config)
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
            moved = recorder.steps - recorder.steps_at_path
            log.info(
                "recorded %d steps in %s%s",
                recorder.steps_at_path,
                recorder.path,
                f" ({moved} more before it was removed or replaced)" if moved else "",
            )
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
    # before start, not a bare errno after; appended to in place, so a FIFO may take the stream
    problem = output_problem("--record-steps", args.record_steps, appended=True)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        config.check_files()
        if not config.snapshot_path.exists():
            # A first start loads it: refused here, before the state directory and its lock exist
            # (a restart takes the snapshot's policy and does not read it).
            config.load_default_policy()
    except ConfigError as e:
        print(f"error: {e.located(args.config or '<defaults>')}", file=sys.stderr)
        return 2
    except PolicyError as e:
        print(f"error: {args.config or '<defaults>'}: default_policy: {e}", file=sys.stderr)
        return 2
    problem = _record_steps_problem(args.record_steps, config, args.config)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config, record_steps=Path(args.record_steps) if args.record_steps else None))
    except PolicyError as e:
        print(f"error: {args.config or '<defaults>'}: default_policy: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found at bind time (a socket path naming something else)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (StateDirLocked, SocketInUse) as e:  # the state dir or a socket path held by another process
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as e:  # grpc reports a failed bind as RuntimeError
        taken = taken_addresses(config)
        if taken:
            print(
                "error: cannot listen: "
                + "; ".join(f"{field} {addr} is taken (another sidecar?)" for field, addr in taken)
                + " (set another port in the config, or 0 for any free port)",
                file=sys.stderr,
            )
        else:
            print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    return 0


def _record_steps_problem(path: str | None, config: SidecarConfig, config_file: str | None) -> str | None:
    """Why ``--record-steps`` may not be ``path`` (None: it may, or none is asked for): a file the
    sidecar reads (its config, default policy, token, password and TLS files), keeps its state in, or
    owns (its state directory's lock, its Unix sockets, its temporary files).
    The steps were appended to it: `--record-steps sidecar.yaml` left a config the next start refused,
    and the snapshot's rename dropped them."""
    if not path:
        return None
    policy_file = config.default_policy if os.path.isfile(config.default_policy) else ""  # (else a preset)
    named: list[tuple[str, str | Path]] = [("--config", config_file or ""), ("default_policy", policy_file)]
    named += [
        (f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if f.name.endswith("_file")
    ]
    named += [("state_dir", config.snapshot_path), ("state_dir", config.endpoints_path)]
    for what, other in named:
        if other and same_file(path, other):
            return f"--record-steps {path}: is the {what} file it reads; name another output"
    # What the sidecar makes and owns: the lock (its pid line, which a second sidecar names, would be
    # buried), the Unix sockets it binds (a file there fails the bind), and the temporary files of its
    # atomic writes (a start removes the snapshot's).
    owned: list[tuple[str, str | Path]] = [
        (f"the state_dir's lock file ({LOCK_NAME})", Path(config.state_dir) / LOCK_NAME)
    ]
    for side in ("engine", "admin"):
        addr = parse_address(config.listen_address(side), field=f"{side}_listen")
        if isinstance(addr, str):
            owned.append((f"the {side}_listen socket", addr))
    for what, other in owned:
        if same_file(path, other):
            return f"--record-steps {path}: is {what}; name another output"
    p = Path(path)
    temporary = tuple(f".{f.name}." for f in (config.snapshot_path, config.endpoints_path))
    if p.name.startswith(temporary) and p.name.endswith(".tmp") and same_file(p.parent, config.state_dir):
        return (
            f"--record-steps {path}: is a temporary file of the sidecar's writes in state_dir; "
            "name another output"
        )
    return None


def taken_addresses(config: SidecarConfig) -> list[tuple[str, str]]:
    """The configured TCP listen addresses that something else holds: ``(field, address)``.

    Asked after a failed start, so that the error names the port rather than grpc's "Failed to bind"."""
    out = []
    for field, value in (
        ("engine_listen", config.engine_address),
        ("admin_listen", config.admin_listen),
        ("metrics_listen", config.metrics_listen),
    ):
        addr = parse_address(value, field=field) if value else ""
        if isinstance(addr, str) or addr[1] == 0:  # a Unix socket, none, or any free port
            continue
        if tcp_address_taken(*addr):
            out.append((field, value))
    return out


if __name__ == "__main__":
    sys.exit(main())
