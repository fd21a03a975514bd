"""``controllerctl``: the sidecar, the demo, and live policy administration over the admin API.

User errors are one line on stderr, never a traceback. Exit 2: usage and input errors (bad flags, a
policy that does not validate, an unknown engine, a file that is not text, a server-side refusal of
the request). Exit 1: runtime errors (the sidecar, broker or /metrics cannot be reached, a file or
stdout cannot be written, the sidecar failed or is rate-limiting: what a retry may cure).
Exit 130: interrupted (Ctrl-C; a second Ctrl-C ends the process at once). ``--json`` prints one
JSON document on stdout: numbers as JSON numbers (int64 fields too, which protobuf's JSON mapping
would quote), every field of a message in every state, in the .proto's order. Human tables are one
line per row whatever the names hold (what does not print is escaped). Policies are parsed
locally before anything is sent, so a broken file never reaches the sidecar.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import unicodedata
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict

from controller.auth import ClientTLS
from controller.client import AdminClient
from controller.config import MAX_FLEET_NAME
from controller.errors import not_regular
from controller.v1 import controller_pb2 as pb
from controller.wire.names import engine_id_problem
from policies.presets import resolve_policy_text
from policies.spec import PolicyError, PolicySpec, parse_policy
from policies.text import error_text, name_problem, one_line
from sim import cli_types
from sim.cli import register as register_sim_commands
from sim.files import output_problem, replace_file

if TYPE_CHECKING:
    from controller._mqtt import BrokerSettings

DEFAULT_ADMIN = "127.0.0.1:50062"
ADMIN_ENV = "SPECCONTROL_ADMIN"
#: The admin bearer token itself (``--token-file`` takes precedence).
ADMIN_TOKEN_ENV = "SPECCONTROL_ADMIN_TOKEN"
MQTT_URL_ENV = "SPECCONTROL_MQTT_URL"
#: The broker password when the URL names a user but no password (keeps it out of ``ps``).
MQTT_PASSWORD_ENV = "SPECCONTROL_MQTT_PASSWORD"
FLEET_ENV = "SPECCONTROL_FLEET"
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
#: The sidecar could not do what was asked, through no fault of the request: a state write failed
#: (ABORTED), it is rate-limiting policy changes ("retry later": RESOURCE_EXHAUSTED), its handler
#: failed (UNKNOWN, INTERNAL) or it went away mid-call (CANCELLED). A retry may succeed, so exit 1.
_RUNTIME = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}
_GRANULARITY = {0: "-", 1: "batch", 2: "request-k", 3: "request-method"}

T = TypeVar("T")


class UserError(Exception):
    """A one-line error for the user, with the exit code to use."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# -- helpers -------------------------------------------------------------------------------------------


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def _arm(a: pb.Arm) -> str:
    return "off" if a.method == "off" or not a.method else f"{a.method}:{a.k}"


def _dump(msg: Any) -> dict[str, Any]:
    """A message as JSON-ready data with numbers as numbers (protobuf's mapping quotes 64-bit ints)."""
    out: dict[str, Any] = MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _unquote_int64(msg.DESCRIPTOR, out)
    return _in_proto_order(msg.DESCRIPTOR, out)


def _in_proto_order(desc: Descriptor, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its keys in the .proto's field order, nested messages too. MessageToDict puts the
    fields that are set first and the defaults after them, so the order changed with the state (an
    engine's ``rejected`` moved from after ``max_k`` to after ``steps`` once it was not 0)."""
    out: dict[str, Any] = {}
    for f in desc.fields:
        if f.name not in doc:
            continue
        v = doc[f.name]
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            sub = f.message_type
            v = [_in_proto_order(sub, x) for x in v] if isinstance(v, list) else _in_proto_order(sub, v)
        out[f.name] = v
    out.update((k, v) for k, v in doc.items() if k not in out)  # (none expected: kept, not lost)
    return out


_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
    FieldDescriptor.TYPE_SINT64,
}


def _unquote_int64(desc: Descriptor, doc: dict[str, Any]) -> None:
    for f in desc.fields:
        if f.name not in doc:
            continue
        repeated = isinstance(doc[f.name], list)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = f.message_type.fields_by_name["value"]
            for k, v in doc[f.name].items():
                if value.message_type is not None:
                    _unquote_int64(value.message_type, v)
                elif value.type in _INT64:
                    doc[f.name][k] = int(v)
        elif f.message_type is not None:
            for item in doc[f.name] if repeated else [doc[f.name]]:
                _unquote_int64(f.message_type, item)
        elif f.type in _INT64:
            doc[f.name] = [int(v) for v in doc[f.name]] if repeated else int(doc[f.name])


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _cell(value: object) -> str:
    """``value`` as one table cell: every character that does not print (control characters, line
    breaks, zero-width and bidirectional marks, odd spaces) escaped as Python writes it (``\\u200b``),
    so a row stays one line and two ids that differ only there do not look alike."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _width(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide characters take two, combining marks none."""
    if text.isascii():
        return len(text)
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text
    )


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_cell(x) for x in head], *[[_cell(x) for x in r] for r in rows]]
    widths = [max(_width(r[i]) for r in cells) for i in range(len(head))]
    lines = [
        "  ".join(c + " " * (w - _width(c)) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def read_policy(name_or_path: str) -> tuple[str, str, PolicySpec]:
    """``(yaml, source, spec)`` for a file path or a preset name; raises UserError (exit 2)."""
    from controller.validation import parse_policy_checked

    try:
        text, source = resolve_policy_text(name_or_path)
        return text, source, parse_policy_checked(text, source=source)
    except PolicyError as e:
        raise UserError(one_line(str(e))) from None


def _refuse_empty_files(*flags: tuple[str, str | None]) -> None:
    """UserError (exit 2) for a file flag given as '' (an unset variable in a script): it was taken
    for the flag left out, and what the file was for dropped without a word."""
    for flag, path in flags:
        if path == "":
            raise UserError(f"{flag} '': not a file name")


def _admin_auth(args: argparse.Namespace) -> tuple[str, ClientTLS | None]:
    """The bearer token (``--token-file`` or ``$SPECCONTROL_ADMIN_TOKEN``) and TLS settings."""
    from controller.config import header_safe, read_secret_file
    from controller.errors import ConfigError

    # TLS dropped without a word (the bearer token then sent in plaintext), or $SPECCONTROL_ADMIN_TOKEN
    # sent in place of the file's.
    _refuse_empty_files(
        ("--token-file", args.token_file),
        ("--admin-ca-file", args.admin_ca_file),
        ("--admin-cert-file", args.admin_cert_file),
        ("--admin-key-file", args.admin_key_file),
    )
    token = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    source = f"${ADMIN_TOKEN_ENV}"
    if args.token_file:
        problem = not_regular(args.token_file)
        if problem:  # (read_secret_file refuses it too; here with where a piped token goes instead)
            raise UserError(
                f"--token-file: {one_line(args.token_file)}: {problem} (a token from a pipe goes in "
                f"${ADMIN_TOKEN_ENV})"
            )
        try:
            token = read_secret_file(args.token_file, field="--token-file")
        except ConfigError as e:
            raise UserError(str(e).removeprefix("<config>: ")) from None
        source = f"--token-file {one_line(args.token_file)}"
    if not header_safe(token):  # (gRPC refused it inside the call: an ExecuteBatchError traceback)
        raise UserError(f"{source}: the token must be printable ASCII characters")
    tls = None
    if args.admin_ca_file or args.admin_cert_file or args.admin_key_file:
        try:
            tls = ClientTLS(
                ca_file=args.admin_ca_file or "",
                cert_file=args.admin_cert_file or "",
                key_file=args.admin_key_file or "",
                server_name=args.admin_server_name or "",
            )
        except ValueError as e:
            raise UserError(f"--admin-cert-file/--admin-key-file: {e}") from None
        _check_client_tls(tls)
    return token, tls


def _check_client_tls(tls: ClientTLS) -> None:
    """The admin TLS files read and parsed now, as OpenSSL will (Python's ssl): gRPC took a file that
    is no certificate, logged a line of its own ("Update handshaker factory failed") and the call
    failed as "cannot reach the sidecar ... Failed to create security handshaker", exit 1, naming no
    file. Raises UserError (exit 2) naming the flag."""
    import ssl

    files = (
        ("--admin-ca-file", tls.ca_file),
        ("--admin-cert-file", tls.cert_file),
        ("--admin-key-file", tls.key_file),
    )
    for flag, path in files:
        if path:
            problem = not_regular(path)
            if problem:
                raise UserError(f"{flag}: {one_line(path)}: {problem}")
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise UserError(f"{flag}: cannot read {one_line(path)}: {error_text(e)}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.ca_file)
        except ssl.SSLError as e:
            raise UserError(
                f"--admin-ca-file {one_line(tls.ca_file)}: not a CA certificate bundle ({e.reason or e})"
            ) from None
    if tls.cert_file:
        try:
            # (password: an encrypted key would otherwise have OpenSSL ask for one on the terminal)
            ctx.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
        except ssl.SSLError as e:
            raise UserError(
                f"--admin-cert-file {one_line(tls.cert_file)} with --admin-key-file {one_line(tls.key_file)}: "
                f"not a certificate and its own unencrypted key ({e.reason or e})"
            ) from None


def _admin_call(args: argparse.Namespace, fn: Callable[[AdminClient], Awaitable[T]]) -> T:
    problem = _admin_problem(args.admin) if isinstance(args.admin, _FromEnvironment) else None
    if problem is not None:
        raise UserError(f"${ADMIN_ENV}: {problem} (or give --admin ADDR)")
    token, tls = _admin_auth(args)

    async def go() -> T:
        async with AdminClient(target=args.admin, timeout=args.timeout, token=token, tls=tls) as admin:
            return await fn(admin)

    try:
        return asyncio.run(go())
    except ValueError as e:  # an unreadable TLS file
        raise UserError(f"admin TLS: {e}") from None
    except grpc.aio.AioRpcError as e:
        details = (e.details() or e.code().name).splitlines()[0]
        if e.code() in _UNREACHABLE:
            raise UserError(f"cannot reach the sidecar at {args.admin}: {details}", 1) from None
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise UserError(
                f"unauthenticated: {details} (give the token with --token-file or ${ADMIN_TOKEN_ENV})", 2
            ) from None
        raise UserError(f"{e.code().name.lower()}: {details}", 1 if e.code() in _RUNTIME else 2) from None


# -- commands --------------------------------------------------------------------------------------------


def _config_file_problem(path: str) -> str | None:
    """Why a sidecar config path that names a device is refused (None: it is not): the config is read
    whole, and ``/dev/zero`` or ``/dev/urandom`` (a slip of the shell) grew the process by gigabytes a
    second until it was killed for memory. A FIFO is taken (``config validate /dev/stdin`` from a pipe);
    a path that cannot be read is left to the reader, which says why."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        return f"{one_line(path)}: not a config file (a device or socket): name a YAML file"
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    from controller.errors import ConfigError
    from controller.serve import main as serve_main

    problem = _config_file_problem(args.config) if args.config else None
    if problem is not None:
        raise UserError(f"error: {problem}")  # (as serve's own errors read)
    try:
        # Passed on when given at all: '' (an unset variable) is a file name serve refuses, not no
        # flag (the defaults were served, or nothing recorded, without a word).
        argv = ["--config", args.config] if args.config is not None else []
        if args.record_steps is not None:
            argv += ["--record-steps", args.record_steps]
        return serve_main(argv)
    except ConfigError as e:  # found at start, e.g. an unreadable mqtt_password_file
        raise UserError(f"error: {e}") from None


#: ObserverSettings' fields as the flags that set them (its errors name the field).
_OBSERVE_FLAGS = {
    "metrics_url": "--metrics-url",
    "engine_target": "--sidecar",
    "engine_id": "--engine-id",
    "max_k": "--max-k",
    "interval_s": "--interval",
    "retries": "--retries",
    "model": "--model",
    "model_name": "--model-name",
}


def cmd_observe(args: argparse.Namespace) -> int:
    from controller import _interrupt as interrupt
    from controller.observe import MIN_INTERVAL_S, ObserverError, ObserverSettings, run_observer
    from policies.arms import Method

    # Raised to the floor, not refused: a scrape interval below it is too eager rather than wrong (one
    # out of (0, 3600] at all, NaN included, is the settings' own error below: exit 2).
    clamped = 0 < args.interval < MIN_INTERVAL_S
    interval = MIN_INTERVAL_S if clamped else args.interval
    try:
        settings = ObserverSettings(
            metrics_url=args.metrics_url,
            engine_target=args.sidecar,
            engine_id=args.engine_id,
            model=args.model,
            model_name=args.model_name,
            method=Method(args.method),
            max_k=args.max_k,
            interval_s=interval,
            retries=args.retries,
        )
    except ValueError as e:
        field, _, why = str(e).partition(":")
        raise UserError(f"error: {_OBSERVE_FLAGS.get(field, field)}:{why}") from None
    if clamped:  # (said once the rest is known good: a usage error is one line)
        _err(
            f"observe: --interval {args.interval:g} s is below the floor of {MIN_INTERVAL_S:g} s (each "
            f"scrape makes vLLM render all its metrics); scraping every {MIN_INTERVAL_S:g} s"
        )

    shown: list[int] = []

    def show(d: Any) -> None:
        if shown and shown[-1] == d.version:  # a refresh of the same recommendation
            return
        shown.append(d.version)
        print(
            f"recommend v{d.version}: K table {[(r.bs_min, r.bs_max, r.k) for r in d.k_table]} ({d.reason})",
            flush=True,
        )

    print(
        f"observing {args.metrics_url} as {args.engine_id} for the sidecar at {args.sidecar} "
        "(recommends only, once there is data; Ctrl-C to stop)",
        flush=True,
    )
    try:
        # (interrupt.run: Ctrl-C cancels the observer, never raises inside its gRPC stream's tasks)
        sent = interrupt.run(run_observer(settings, on_directive=show, on_status=_err))
    except ObserverError as e:
        raise UserError(f"error: {e}", 1) from None
    print(f"sent {sent} observations")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from controller.demo import main as demo_main

    problem = output_problem("--plot", args.plot, suffix=".png")
    if problem is not None:
        raise UserError(problem)
    try:
        return demo_main(seconds=args.seconds, as_json=args.json, seed=args.seed, plot_path=args.plot)
    except BrokenPipeError:
        raise  # the reader went away (`demo | head`): main's rule, exit 1 and nothing said
    except (RuntimeError, OSError) as e:
        raise UserError(f"demo: {e}", code=1) from None


def _policy_line(p: pb.PolicyInfo) -> str:
    scope = f"engine {p.engine_id}" if p.engine_id else "default"
    return f"{p.name} ({p.algorithm}) revision {p.revision} for {scope}, from {p.source or '-'}"


def cmd_policy_validate(args: argparse.Namespace) -> int:
    _, source, spec = read_policy(args.file)
    arms = ", ".join(str(a) for a in spec.arms) or "all the engine offers"
    print(
        f"OK {source}: policy {spec.name!r}, algorithm {spec.algorithm}, arms: {arms}, "
        f"rule {spec.rule.kind}, decisions every {spec.decision_interval_s:g} s"
    )
    return 0


def _fleet_broker(args: argparse.Namespace) -> BrokerSettings:
    """The broker for ``--fleet`` from ``--broker`` or the environment; raises UserError (exit 2)."""
    from controller._mqtt import BrokerSettings

    if args.broker == "":  # (an unset variable: $SPECCONTROL_MQTT_URL was taken in its place)
        raise UserError("--broker '': not a broker URL")
    # (the system's CAs were trusted in place of --ca-file's, and no client certificate was sent)
    _refuse_empty_files(
        ("--ca-file", args.ca_file), ("--cert-file", args.cert_file), ("--key-file", args.key_file)
    )
    # Read only when the link connects (ssl): a FIFO there hung the command.
    for flag, path in (
        ("--ca-file", args.ca_file),
        ("--cert-file", args.cert_file),
        ("--key-file", args.key_file),
    ):
        problem = not_regular(path) if path else None
        if problem:
            raise UserError(f"{flag}: {one_line(path)}: {problem}")
    url = args.broker or os.environ.get(MQTT_URL_ENV, "")
    if not url:
        raise UserError(f"--fleet needs the MQTT broker: --broker mqtt[s]://host[:port] or ${MQTT_URL_ENV}")
    opts: dict[str, object] = {
        k: v
        for k, v in (("ca_file", args.ca_file), ("cert_file", args.cert_file), ("key_file", args.key_file))
        if v
    }
    try:
        broker = BrokerSettings.from_url(url, **opts)
        password = os.environ.get(MQTT_PASSWORD_ENV)
        if broker.username is not None and broker.password is None and password:
            broker = BrokerSettings.from_url(url, password=password, **opts)
    except (TypeError, ValueError) as e:
        # (the URL from the environment named as such: --broker was blamed for a flag not given)
        where = "--broker" if args.broker else f"${MQTT_URL_ENV}"
        raise UserError(f"{where}: {str(e).splitlines()[0]}") from None
    return broker


def _fleet_name(args: argparse.Namespace) -> str:
    """The fleet for ``--fleet`` from ``--fleet-name`` or the environment; raises UserError (exit 2)."""
    # --fleet-name '' is refused below, not taken for the flag left out: the policy went to the fleet
    # 'default', every sidecar of it.
    fleet = args.fleet_name if args.fleet_name is not None else os.environ.get(FLEET_ENV) or "default"
    problem = name_problem(fleet, longest=MAX_FLEET_NAME)
    if problem is not None:
        where = "--fleet-name" if args.fleet_name is not None else f"${FLEET_ENV}"
        raise UserError(f"{where}: {problem}")
    return str(fleet)


def _on_broker(broker: BrokerSettings, timeout_s: float, call: Coroutine[Any, Any, T]) -> T:
    """Run ``call`` against the broker; unreachable or silent is one line and exit 1."""
    from controller._mqtt import ConnectionLost

    try:
        return asyncio.run(call)
    except ConnectionLost as e:
        raise UserError(f"cannot reach the MQTT broker: {str(e).splitlines()[0]}", 1) from None
    except TimeoutError:
        raise UserError(
            f"the MQTT broker at {broker.describe()} did not answer within {timeout_s:g} s", 1
        ) from None


def _set_fleet_policy(args: argparse.Namespace, text: str, source: str, name: str) -> int:
    from controller.fleet import FleetVersionsUsedUp, publish_fleet_policy

    broker = _fleet_broker(args)
    fleet = _fleet_name(args)
    publish = publish_fleet_policy(
        broker=broker, fleet=fleet, yaml=text, source=source, timeout_s=args.timeout
    )
    try:
        version = _on_broker(broker, args.timeout, publish)
    except FleetVersionsUsedUp as e:  # the fleet's state, not the file: a runtime error
        raise UserError(f"fleet {fleet}: {one_line(str(e))}", 1) from None
    except ValueError as e:
        raise UserError(f"{source}: {one_line(str(e))}") from None
    print(f"published {name} from {source} to fleet {fleet} as version {version} ({broker.describe()})")
    return 0


def cmd_policy_set(args: argparse.Namespace) -> int:
    text, source, spec = read_policy(args.policy)
    if args.fleet:
        return _set_fleet_policy(args, text, source, spec.name)
    if any(
        v is not None for v in (args.broker, args.fleet_name, args.ca_file, args.cert_file, args.key_file)
    ):
        raise UserError("--broker, --fleet-name, --ca-file, --cert-file and --key-file go with --fleet")

    async def set_policy(a: AdminClient) -> pb.PolicyInfo:
        if args.engine:
            known = sorted(e.engine_id for e in await a.engines())
            if args.engine not in known:
                raise UserError(
                    f"--engine: no engine {args.engine!r} has attached to the sidecar at {args.admin} "
                    f"(attached: {', '.join(known) or 'none'}; see controllerctl engines)"
                )
        return await a.set_policy(text, source=source, engine_id=args.engine or "")

    info = _admin_call(args, set_policy)
    print(f"set {_policy_line(info)}")
    return 0


def cmd_policy_clear(args: argparse.Namespace) -> int:
    """Clear the fleet's policy: a retained tombstone every sidecar applies (its engines go back to
    its local policy) and none puts the cleared policy back, also one disconnected meanwhile."""
    from controller.fleet import publish_fleet_clear

    if not args.fleet:
        raise UserError(
            "policy clear: --fleet is required (only a fleet's policy is cleared; a sidecar's own: "
            "policy set or policy rollback)"
        )
    broker = _fleet_broker(args)
    fleet = _fleet_name(args)
    version, found = _on_broker(
        broker, args.timeout, publish_fleet_clear(broker=broker, fleet=fleet, timeout_s=args.timeout)
    )
    if args.json:
        _print_json(
            {
                "fleet": fleet,
                "broker": broker.describe(),
                "version": version,
                "previous": {"state": found.state, "version": found.version},
            }
        )
        return 0
    was = {
        "policy": f"its policy version {found.version}",
        "cleared": f"its policy, already cleared as version {found.version},",
        "none": "no policy on the broker",
        "unreadable": "a policy on the broker no sidecar reads",
    }[found.state]
    print(
        f"cleared fleet {fleet} ({was} before) as version {version} ({broker.describe()}): its sidecars "
        "go back to their local policy"
    )
    return 0


def cmd_policy_get(args: argparse.Namespace) -> int:
    async def get_policy(a: AdminClient) -> tuple[pb.PolicyInfo, bool]:
        info = await a.get_policy(args.engine or "")
        # An engine without a policy of its own gets the default's; an id no engine has (a typo) got
        # the same answer, unremarked.
        known = (
            not args.engine or bool(info.engine_id) or args.engine in {e.engine_id for e in await a.engines()}
        )
        return info, known

    info, known = _admin_call(args, get_policy)
    if not known:
        print(
            f"note: no engine {args.engine!r} has attached to the sidecar at {args.admin} (see controllerctl "
            "engines); this is the default policy, which it would follow",
            file=sys.stderr,
        )
    if args.json:
        _print_json(_dump(info))
    else:
        print(f"# {_policy_line(info)}")
        print(info.yaml.rstrip())
    return 0


def cmd_policy_rollback(args: argparse.Namespace) -> int:
    info = _admin_call(args, lambda a: a.rollback_policy(args.engine or ""))
    print(f"rolled back to {_policy_line(info)}")
    return 0


def cmd_policy_list(args: argparse.Namespace) -> int:
    from policies.presets import preset_names, preset_text

    presets: list[dict[str, Any]] = []
    for name in preset_names():
        spec = parse_policy(preset_text(name), source=f"preset:{name}")
        presets.append({"name": name, "algorithm": spec.algorithm, "description": spec.description})
    listed = pb.ListPoliciesResponse()
    reach_error = ""
    try:
        listed = _admin_call(args, lambda a: a.list_policies())
    except UserError as e:
        if e.code != 1:
            raise
        reach_error = str(e)
    active = list(listed.active)
    # The sidecar lists overrides, then the default's history, while they fit half its message limit;
    # when something was left out but none of the history came, some overrides may be missing.
    cut = listed.truncated and not listed.history
    if args.json:
        _print_json(
            {
                "presets": presets,
                "active": [_dump(p) for p in active],
                "truncated": listed.truncated,
                "sidecar": reach_error or "reachable",
            }
        )
        return 0
    print("presets (policies/library):")
    print(
        _table(
            ["name", "algorithm", "description"],
            [[p["name"], p["algorithm"], p["description"]] for p in presets],
        )
    )
    print()
    if reach_error:
        print(f"active: unknown ({reach_error})")
    else:
        print("active:")
        rows = [[p.engine_id or "(default)", p.name, p.algorithm, p.revision, p.source] for p in active]
        print(_table(["scope", "name", "algorithm", "revision", "source"], rows))
        if cut:
            print(
                f"(the first {len(active) - 1} engine policies only: the sidecar lists what fits its "
                "message limit; `controllerctl policy get --engine ID` shows any engine's)"
            )
    return 0


def _engine_rows(engines: Sequence[pb.EngineStatus]) -> str:
    rows = []
    for e in engines:
        arms = ", ".join(f"{c.context}={_arm(c.arm)}" for c in e.arms if c.goodput_tok_s > 0)
        rows.append(
            [
                e.engine_id,
                "yes" if e.connected else "no",
                e.policy,
                e.directive_version,
                f"{e.directive_age_s:.1f}s",
                e.steps,
                f"{e.acceptance_rate:.2f}",
                f"{e.goodput_tok_s:.0f}",
                _GRANULARITY.get(int(e.granularity), "?"),
                "recommends only" if e.observe_only else "applies",
                e.plugin_mode or "-",
                arms or "-",
            ]
        )
    head = [
        "engine",
        "connected",
        "policy",
        "directive",
        "age",
        "steps",
        "accept",
        "goodput",
        "granularity",
        "control",
        "plugin mode",
        "arms",
    ]
    return _table(head, rows)


def _utc(unix_s: float) -> str:
    """A unix time as a UTC date and time a reader can take in (the raw seconds where it is none)."""
    import time

    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))
    except (OverflowError, OSError, ValueError):  # beyond what the platform's calendar holds
        return f"{unix_s:g} s after 1970"


def _fleet_line(f: pb.FleetLinkStatus) -> str:
    link = "connected" if f.connected else "not connected (retrying)"
    if not f.policy_version:
        policy = "no fleet policy applied"
    else:
        policy = f"fleet policy v{f.policy_version}" + (" (the clear)" if f.policy_cleared else "")
    return f"{f.fleet} on {f.broker} as {f.node_id}, {link}; {policy}"


def cmd_status(args: argparse.Namespace) -> int:
    st = _admin_call(args, lambda a: a.status())
    if args.json:
        doc = _dump(st)
        doc.setdefault("fleet", None)  # (a key tools can rely on: null where there is no fleet link)
        _print_json(doc)
        return 0
    snap = "never" if not st.last_snapshot_s else _utc(st.last_snapshot_s)
    print(f"sidecar {st.version} at {args.admin}, up {st.uptime_s:.0f} s")
    print(f"default policy: {_policy_line(st.policy)}")
    print(f"snapshot: {st.snapshot_path} (last {snap})")
    print(f"fleet: {_fleet_line(st.fleet) if st.HasField('fleet') else 'none (mqtt_url is empty)'}")
    if st.engines_truncated:  # the status message holds what fits; `engines` pages through them all
        print(
            f"engines: {st.engines_total} (the first {len(st.engines)} below; `controllerctl engines` lists all)"
        )
    else:
        print(f"engines: {len(st.engines)}")
    if st.engines:
        print(_engine_rows(st.engines))
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    engines = _admin_call(args, lambda a: a.engines())
    if args.json:
        _print_json({"engines": [_dump(e) for e in engines]})
    elif not engines:
        print("no engines have attached")
    else:
        print(_engine_rows(engines))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from controller.config_reference import reference_markdown

    problem = output_problem("--out", args.out)
    if problem is not None:
        raise UserError(problem)
    text = reference_markdown()
    if args.out:
        replace_file(args.out, text.encode())
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from controller.config import load_config
    from controller.errors import ConfigError

    problem = _config_file_problem(args.file)
    if problem is not None:
        raise UserError(problem)
    try:
        cfg = load_config(args.file)
        if not args.no_files:
            cfg.check_files()  # the files serve reads before it binds
        policy, source = cfg.load_default_policy()  # what serve loads at a first start
    except ConfigError as e:
        raise UserError(str(e.located(args.file))) from None
    except PolicyError as e:
        raise UserError(f"{args.file}: default_policy: {e}") from None
    print(
        f"OK {args.file}: engines on {cfg.engine_address}, admin on {cfg.admin_listen}, "
        f"default policy {policy.name!r} ({source})"
    )
    return 0


# -- parser ----------------------------------------------------------------------------------------------


def package_version() -> str:
    """The installed speccontrol version (``0+unknown`` when run from a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("speccontrol")
    except PackageNotFoundError:
        return "0+unknown"


def _engine_id(text: str) -> str:
    """``--engine ID``: an engine id as engines send it. An empty one is refused: to the admin API it
    means the default policy, so ``--engine "$UNSET"`` would have set (or rolled back) every engine's."""
    if not text:
        raise argparse.ArgumentTypeError("empty engine id (leave out --engine for the default policy)")
    problem = engine_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


class _FromEnvironment(str):
    """``--admin``'s default ($SPECCONTROL_ADMIN): a bad one is an error of the commands that dial
    it, not of every command (``policy validate``, ``config reference`` and ``sim`` refused to run)."""


def _admin_problem(text: str) -> str | None:
    from controller.errors import ConfigError
    from controller.wire.address import parse_address

    try:
        parse_address(text, field="admin", dial=True)
    except ConfigError as e:
        return e.message
    return None


def _admin_address(text: str) -> str:
    """``--admin`` (or $SPECCONTROL_ADMIN): an address a client can dial. A port beyond 65535 would
    otherwise wrap around to another port (the token and the change would go there)."""
    problem = _admin_problem(text)
    if problem is not None:
        if isinstance(text, _FromEnvironment):  # (argparse passes a default through here too)
            return text  # said by _admin_call, when a command dials it
        raise argparse.ArgumentTypeError(f"{problem} (from --admin or ${ADMIN_ENV})")
    return str(text)


def _add_broker_options(s: argparse.ArgumentParser) -> None:
    """The broker and fleet options of ``policy set --fleet`` and ``policy clear --fleet``."""
    s.add_argument(
        "--broker",
        metavar="URL",
        help=f"with --fleet: mqtt[s]://[user[:password]@]host[:port] (default: ${MQTT_URL_ENV}; "
        f"a password can come from ${MQTT_PASSWORD_ENV})",
    )
    s.add_argument(
        "--fleet-name", metavar="NAME", help=f"with --fleet: the fleet (default: ${FLEET_ENV} or 'default')"
    )
    s.add_argument("--ca-file", metavar="FILE", help="with --fleet and mqtts://: CA bundle of the broker")
    s.add_argument("--cert-file", metavar="FILE", help="with --fleet and mqtts://: client certificate (mTLS)")
    s.add_argument("--key-file", metavar="FILE", help="with --fleet and mqtts://: client key (mTLS)")


def build_parser() -> argparse.ArgumentParser:
    p = cli_types.OneLineParser(prog="controllerctl", description="Adaptive speculation controller for vLLM.")
    p.add_argument("--version", action="version", version=f"controllerctl {package_version()}")
    p.add_argument(
        "--admin",
        default=_FromEnvironment(os.environ.get(ADMIN_ENV) or DEFAULT_ADMIN),
        type=_admin_address,
        metavar="ADDR",
        help=f"sidecar admin address (default: ${ADMIN_ENV} or {DEFAULT_ADMIN})",
    )
    p.add_argument(
        "--timeout",
        type=cli_types.float_in(0, 3600, lo_open=True),
        default=5.0,
        metavar="S",
        help="admin (or broker) call timeout in seconds",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"admin bearer token from this file (default: the token itself in ${ADMIN_TOKEN_ENV}); needed to "
        "set or roll back policies when the sidecar has admin_token_file",
    )
    p.add_argument(
        "--admin-ca-file", metavar="FILE", help="admin API over TLS: the CA of the sidecar's certificate"
    )
    p.add_argument("--admin-cert-file", metavar="FILE", help="admin API mTLS: client certificate")
    p.add_argument("--admin-key-file", metavar="FILE", help="admin API mTLS: client key")
    p.add_argument(
        "--admin-server-name",
        metavar="NAME",
        help="admin API over TLS: expected name in the sidecar's certificate",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("serve", help="run the sidecar")
    s.add_argument("--config", metavar="FILE", help="sidecar YAML config")
    s.add_argument(
        "--record-steps", metavar="FILE", help="append applied engine steps to FILE (for profile fit)"
    )
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("demo", help="sidecar + simulated engines: adaptive vs static, live")
    s.add_argument(
        "--seconds",
        type=cli_types.float_in(0, 3600, lo_open=True),
        default=40.0,
        metavar="N",
        help="seconds of an engine's traffic, played at up to twice real time (default 40)",
    )
    s.add_argument("--seed", type=cli_types.seed, default=0, help="traffic seed (default 0)")
    s.add_argument("--json", action="store_true", help="print the result as JSON only")
    s.add_argument("--plot", metavar="FILE", help="also draw goodput over time per engine (PNG)")
    s.set_defaults(func=cmd_demo)

    pol = sub.add_parser("policy", help="set, get, list, validate, roll back or clear (--fleet) policies")
    psub = pol.add_subparsers(dest="policy_command", metavar="ACTION")
    psub.required = True
    s = psub.add_parser("set", help="validate locally, then set a policy (file or preset name)")
    s.add_argument("policy", metavar="FILE|NAME")
    scope = s.add_mutually_exclusive_group()
    scope.add_argument(
        "--engine",
        metavar="ID",
        type=_engine_id,
        help="only this engine (default: the sidecar's default policy)",
    )
    scope.add_argument("--fleet", action="store_true", help="every sidecar of the fleet (over MQTT)")
    _add_broker_options(s)
    s.set_defaults(func=cmd_policy_set)
    s = psub.add_parser(
        "clear", help="clear the fleet's policy (--fleet): every sidecar goes back to its local policy"
    )
    s.add_argument("--fleet", action="store_true", help="the fleet's policy, over MQTT (required)")
    _add_broker_options(s)
    s.add_argument("--json", action="store_true", help="one JSON document: fleet, broker, version, previous")
    s.set_defaults(func=cmd_policy_clear)
    s = psub.add_parser("get", help="the policy in force")
    s.add_argument(
        "--engine", metavar="ID", type=_engine_id, help="this engine's (default: the default policy)"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_policy_get)
    s = psub.add_parser("list", help="presets, and the active policies when a sidecar is reachable")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_policy_list)
    s = psub.add_parser("validate", help="check a policy file locally (no sidecar)")
    s.add_argument("file", metavar="FILE")
    s.set_defaults(func=cmd_policy_validate)
    s = psub.add_parser("rollback", help="back to the previous policy")
    s.add_argument(
        "--engine", metavar="ID", type=_engine_id, help="this engine's (default: the default policy)"
    )
    s.set_defaults(func=cmd_policy_rollback)

    s = sub.add_parser("status", help="the sidecar, its policy and engines")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("engines", help="attached engines")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_engines)
    s = sub.add_parser(
        "observe", help="observe-only: feed a vLLM without the plugin (its /metrics) to the sidecar"
    )
    s.add_argument("--metrics-url", required=True, help="e.g. http://127.0.0.1:8000/metrics")
    s.add_argument("--sidecar", required=True, metavar="ADDR", help="the sidecar's engine address")
    s.add_argument("--engine-id", required=True)
    s.add_argument("--model", default="vllm")
    s.add_argument(
        "--model-name",
        default=None,
        help="read only the samples with this model_name label (needed where /metrics holds several models)",
    )
    s.add_argument("--method", default="eagle3", choices=["eagle3", "p_eagle", "ngram"])
    s.add_argument("--max-k", type=int, default=4, help="the engine's num_speculative_tokens")
    s.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help="seconds between scrapes, at most 3600 (default 5; below 1 s scrapes every 1 s)",
    )
    s.add_argument(
        "--retries",
        type=int,
        default=10,
        help="consecutive failures to read /metrics or reach the sidecar before giving up (default 10; "
        "retries back off from 0.5 s, doubling, to 30 s)",
    )
    s.set_defaults(func=cmd_observe)

    s = sub.add_parser("config", help="the sidecar's configuration keys")
    csub = s.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    s = csub.add_parser("reference", help="every key of the sidecar config, with type, default and meaning")
    s.add_argument("--out", metavar="FILE", help="write Markdown here (default: stdout)")
    s.set_defaults(func=cmd_config_reference)
    s = csub.add_parser("validate", help="check a sidecar config file (FILE:LINE: field: message)")
    s.add_argument("file", metavar="FILE")
    s.add_argument(
        "--no-files",
        action="store_true",
        help="check the document only, not the files it names (state_dir, tokens, TLS): for a config "
        "written for another machine, e.g. a pod's mounted secrets",
    )
    s.set_defaults(func=cmd_config_validate)

    register_sim_commands(sub)  # sim, profile, trace
    return p


def _escaping_output() -> None:
    """stdout (and stderr) escape what their encoding cannot write (``\\u5f15``) instead of raising: an
    engine id in Chinese under LC_ALL=C with PYTHONUTF8=0, or PYTHONIOENCODING=ascii, ended the
    engines table with a UnicodeEncodeError traceback. (JSON is ASCII already.)"""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError, TypeError):
                reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    _escaping_output()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
        if func is None:
            parser.print_help(sys.stderr)
            return 2
        if sys.stdout is None and func is not cmd_serve:
            # Started with stdout closed (`>&-`): Python drops what is printed, so `status --json`
            # said nothing with exit 0 (and `config reference` raised a traceback). Refused before
            # anything runs, so a `policy set` is not made and then unreported. (serve prints nothing.)
            raise UserError("error: stdout is closed; controllerctl writes its output there", 1)
        code = func(args)
        if sys.stdout is not None:
            sys.stdout.flush()  # a full disk is said here, not as "Exception ignored" at exit
        return code
    except UserError as e:
        _err(str(e))
        return e.code
    except KeyboardInterrupt:
        _interrupted()
        return 130
    except BrokenPipeError:
        # The reader went away (`controllerctl ... | head`): nothing more to say, and nowhere to say it.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UnicodeDecodeError as e:
        _err(f"error: an input file is not UTF-8 text ({e.reason} at byte {e.start})")
        return 2
    except OSError as e:
        # (no file name: stdout, e.g. /dev/full; one_line("") is "error", which made "error: errorNo ...")
        where = one_line(f"{e.filename}: ") if e.filename else ""
        _err(f"error: {where}{one_line(error_text(e))}")
        return 1


def _interrupted() -> None:
    """After Ctrl-C: a second one ends the process at once, and half-closed resources stay quiet."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.unraisablehook = lambda _: None
    warnings.simplefilter("ignore")
    _err("interrupted")


if __name__ == "__main__":
    sys.exit(main())
