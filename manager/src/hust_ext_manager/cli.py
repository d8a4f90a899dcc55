"""``vllm-hust-ext``: the command line of the compatible extension manager.

Every ``ValueError``/``OSError`` becomes ``vllm-hust-ext: error: <one line>`` with exit
code 2 (argparse's own convention); ``run`` returns the child's exit code instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hust_ext_manager import __version__, provider
from hust_ext_manager.discovery import InstalledBundle, discover, discover_tolerant
from hust_ext_manager.fileio import read_named_file
from hust_ext_manager.jsonio import JSONInputError, load_json, same_json
from hust_ext_manager.launch import (
    ENABLED_BUNDLES_ENV,
    NATIVE_ENVIRONMENT,
    LaunchPlan,
    check_grace,
    config_file_options,
    has_option,
    ignoring_signals,
    last_value,
    merge_additional_config,
    merge_flag,
    merge_option,
    remove_directory,
    supervise,
    without_option,
    write_native_manifests,
)
from hust_ext_manager.runtime_evidence import (
    EVIDENCE_ENVIRONMENT,
    launch_environment,
    runtime_effective_evidence,
)
from hust_ext_manager.state import ExtensionState, State, load_state, mutate_state

__all__ = ["main"]

# The stock-vLLM adapter (bidkv_ext.hosts.vllm): stock vLLM has no --preemption-policy
# flag, but a `vllm serve` that names one of these scheduler classes takes the policy from
# additional_config["preemption_policy"], which is where `run` puts it then.
_ADAPTER_SCHEDULER = "bidkv_ext.hosts.vllm.policy_scheduler"
_ADAPTER_SCHEDULERS = frozenset(
    f"bidkv_ext.hosts.vllm.{module}{name}"
    for module in ("", "scheduler.")
    for name in ("policy_scheduler", "PolicyScheduler", "PolicyAsyncScheduler")
)
_ADAPTER_CONFIG_KEY = "preemption_policy"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, always: multi-line texts would break the error contract. Only line
        # breaks go: other whitespace is kept, so a named path or value stays exact.
        super().error(" ".join(message.splitlines()))


def _dump(document: object, *, sort_keys: bool = True) -> None:
    print(json.dumps(document, indent=2, sort_keys=sort_keys))


# --- inspect ------------------------------------------------------------------------


def inspect_document(bundle: InstalledBundle, enabled: bool) -> dict[str, Any]:
    m = bundle.manifest
    return {
        "bundle_id": m.extension_id,
        "bundle_version": m.extension_version,
        "distribution": bundle.distribution,
        "distribution_version": bundle.distribution_version,
        "enabled": enabled,
        "kind": m.kind,
        "host": m.host.model_dump(),
        "runtime": m.runtime.model_dump(),
        "lifecycle_owner": m.lifecycle_owner,
        "protocols": [p.model_dump() for p in m.protocols],
        "implementation": [{"type": c.type, **dict(c.attributes)} for c in m.implementation],
        "requires_services": [s.model_dump() for s in m.requires_services],
        "requires_extensions": [],
        "resource_claims": [],
        "activation_ready": m.activation_blocker is None,
        "activation_blocker": m.activation_blocker,
        "experimental": m.experimental,
        "components": [
            {
                **c.model_dump(),
                "contracts": list(c.contracts),
                "execution_planes": list(c.execution_planes),
                "permissions": list(c.permissions),
            }
            for c in m.components
        ],
        "activation": {
            "entry_points": [e.model_dump() for e in m.activation.entry_points],
            "environment": [list(pair) for pair in m.activation.environment],
            "additional_config": [list(pair) for pair in m.activation.additional_config],
        },
        "manifest_path": str(bundle.manifest_path),
    }


def _one(bundle_id: str) -> InstalledBundle:
    return discover([bundle_id])[0]


# --- status -------------------------------------------------------------------------


def _require_vllm_provider(bundle: InstalledBundle) -> None:
    # Only the vLLM Host Provider is implemented (manager-protocol.md section 2).
    name = bundle.manifest.host.provider
    if name != "vllm":
        raise ValueError(f"no Host Provider named {name!r} is installed for {bundle.bundle_id!r}")


def _enabled_peers(bundle_id: str, state: State) -> dict[str, dict[str, Any]]:
    """Raw manifests of the other enabled bundles that load (status never fails on them)."""
    enabled = set(state.enabled_ids()) - {bundle_id}
    if not enabled:
        return {}
    bundles, _ = discover_tolerant()
    return {b.bundle_id: b.raw for b in bundles if b.bundle_id in enabled}


def assess(
    bundle: InstalledBundle,
    state: State,
    *,
    peers: Sequence[InstalledBundle] | None = None,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Status states and evidence, plus what ``run`` needs to decide on refusals.

    ``peers`` (the bundles launching together) and ``command`` are given by ``run``; for
    ``status`` the peers are the other enabled bundles and there is no command.
    """
    manifest = bundle.manifest
    _require_vllm_provider(bundle)
    configuration = state.configuration(bundle.bundle_id)
    states = ["installed", "discovered"]
    result: dict[str, Any] = {"unhealthy": [], "failed_checks": [], "compatible": None}
    try:
        checked = provider.check(manifest, configuration)
    except ValueError as error:
        result.update(states=[*states, "incompatible"], evidence=[str(error)], compatible=False)
        return result
    evidence = list(checked.evidence)
    degraded = checked.degraded
    if checked.compatible is True:
        states.append("compatible")
    elif checked.compatible is False:
        states.append("incompatible")
    if checked.configured:
        states.append("configured")
    if state.is_enabled(bundle.bundle_id):
        states.append("enabled")
    if manifest.requires_services:
        reachable, healthy, lines, unhealthy = provider.service_health(manifest, configuration)
        evidence.extend(lines)
        states.extend(s for s, ok in (("reachable", reachable), ("healthy", healthy)) if ok)
        degraded = degraded or not (reachable and healthy)
        result["unhealthy"] = unhealthy
    others = (
        _enabled_peers(bundle.bundle_id, state)
        if peers is None
        else {b.bundle_id: b.raw for b in peers if b.bundle_id != bundle.bundle_id}
    )
    context = {"enabled_bundles": others, "command": None if command is None else list(command)}
    checks = provider.bundle_checks(bundle, configuration, context)
    for ok, line in checks:
        evidence.append(line)
        if not ok:
            degraded = True
            result["failed_checks"].append(line)
    if degraded:
        states.append("degraded")
    entry_points = {(e.group, e.name) for e in manifest.activation.entry_points}
    live = runtime_effective_evidence(bundle.bundle_id, entry_points)
    if live is not None:
        states.append("runtime_effective")
        evidence.append(live)
    result.update(states=states, evidence=evidence, compatible=checked.compatible)
    return result


def _status(bundle_id: str) -> None:
    bundle = _one(bundle_id)
    assessed = assess(bundle, load_state())
    _dump(
        {
            "extension_id": bundle_id,
            "provider": bundle.manifest.host.provider,
            "states": assessed["states"],
            "evidence": assessed["evidence"],
        },
        sort_keys=False,
    )


# --- state verbs --------------------------------------------------------------------


def _enable(bundle_id: str) -> None:
    blocker = _one(bundle_id).manifest.activation_blocker
    if blocker is not None:
        raise ValueError(f"cannot enable {bundle_id!r}: {blocker}")

    _set_enabled(bundle_id, True)
    print(f"enabled {bundle_id}")


def _disable(bundle_id: str) -> None:
    _set_enabled(bundle_id, False)
    print(f"disabled {bundle_id}")


def _set_enabled(bundle_id: str, enabled: bool) -> None:
    """Store the enabled flag, keeping the bundle's configuration (under the state lock)."""

    def change(state: State) -> State:
        return state.with_entry(
            bundle_id,
            ExtensionState(enabled=enabled, configuration=state.configuration(bundle_id)),
        )

    mutate_state(change)


def _forget(bundle_id: str) -> None:
    def change(state: State) -> State:
        entry = state.entry(bundle_id)
        if entry is None:
            raise ValueError(f"extension {bundle_id!r} has no stored state")
        if entry.enabled:
            raise ValueError(f"disable {bundle_id!r} before forgetting its stored state")
        return state.with_entry(bundle_id, None)

    mutate_state(change)
    print(f"forgot {bundle_id}")


def _configure(bundle_id: str, file: str) -> None:
    _one(bundle_id)
    # Never a plain open(): a named FIFO here would keep the command waiting forever. A
    # shell's unnamed pipe (--file <(...), /dev/stdin) has its writer and is read.
    data = read_named_file(Path(file), f"extension configuration file {file}",
                           "a UTF-8 JSON object in a file or a shell's pipe",
                           unnamed_pipe=True)
    try:
        configuration = load_json(data.decode("utf-8"))
    except (UnicodeDecodeError, JSONInputError) as error:
        raise ValueError(
            f"extension configuration file {file} is not valid UTF-8 JSON: {error}"
        ) from error
    if not isinstance(configuration, dict):
        raise ValueError("extension configuration file must contain an object")

    def change(state: State) -> State:
        return state.with_entry(
            bundle_id,
            ExtensionState(enabled=state.is_enabled(bundle_id), configuration=configuration),
        )

    try:
        mutate_state(change)
    except RecursionError:
        # JSON's reader takes nesting its indenting writer cannot: refused before the state
        # file is touched (the writer serialises before it creates its temporary file).
        raise ValueError(
            f"extension configuration file {file} is nested too deeply to store"
        ) from None
    print(f"configured {bundle_id}")


# --- plans, environment, run --------------------------------------------------------


def _plans(bundles: Sequence[InstalledBundle], state: State) -> list[dict[str, Any]]:
    for bundle in bundles:
        _require_vllm_provider(bundle)
    return [
        provider.plan(b, state.configuration(b.bundle_id), enabled=state.is_enabled(b.bundle_id))
        for b in bundles
    ]


def _claim(claims: dict[str, tuple[str, Any]], key: str, owner: str, value: Any, what: str) -> None:
    """Per-key conflict rule: two bundles conflict only on one key with different values."""
    if key in claims and not same_json(claims[key][1], value):
        raise ValueError(what.format(key=key, first=claims[key][0], second=owner))
    claims.setdefault(key, (owner, value))


def activation_environment(plans: Sequence[dict[str, Any]]) -> dict[str, str]:
    claims: dict[str, tuple[str, Any]] = {}
    plugins: dict[str, str] = {}
    for plan_document in plans:
        owner = plan_document["extension_id"]
        generated = plan_document["generated_config"]
        for key, value in sorted(generated.get("environment", {}).items()):
            _claim(
                claims, key, owner, value, "enabled Bundles disagree on environment variable {key}"
            )
        for name in generated.get("vllm_plugins", []):
            if name in plugins and plugins[name] != owner:
                raise ValueError(
                    f"enabled Bundles {[plugins[name], owner]} both declare vLLM plugin {name!r}"
                )
            plugins[name] = owner
    environment = {key: value for key, (_, value) in claims.items()}
    if plugins:
        names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
        names += [n for n in environment.get("VLLM_PLUGINS", "").split(",") if n]
        names += ["ascend", *plugins]
        environment["VLLM_PLUGINS"] = ",".join(dict.fromkeys(names))
    environment[ENABLED_BUNDLES_ENV] = ",".join(p["extension_id"] for p in plans)
    return environment


def _command(raw: Sequence[str]) -> list[str]:
    if not raw:
        return ["vllm"]
    command = list(raw[1:]) if raw[0] == "--" else list(raw)
    if not command:
        raise ValueError("run requires a command after --")
    return command


def _is_vllm_serve(command: Sequence[str]) -> bool:
    return len(command) > 1 and os.path.basename(command[0]) == "vllm" and command[1] == "serve"


def _through_adapter(command: Sequence[str]) -> bool:
    """Whether ``command`` is a ``vllm serve`` that runs the stock-vLLM adapter."""
    return _is_vllm_serve(command) and last_value(list(command), "--scheduler-cls") in (
        _ADAPTER_SCHEDULERS
    )


def _refuse_for_the_host(bundle: InstalledBundle, state: State, command: list[str]) -> None:
    """A policy bundle's ``vllm serve``: stock vLLM takes it only through our adapter, and
    a host with the contract only through its own ``--preemption-policy``."""
    bundle_id, manifest = bundle.bundle_id, bundle.manifest
    adapter = _through_adapter(command)
    if provider.host_has_preemption_contract(manifest.host.name):
        if adapter:
            raise ValueError(
                f"refusing to launch {bundle_id!r}: the installed vLLM has the "
                f"vllm.preemption-policy contract and takes --preemption-policy itself; "
                f"drop --scheduler-cls {last_value(command, '--scheduler-cls')} (the "
                f"stock-vLLM adapter runs on stock vLLM 0.33.0 only)"
            )
        return
    if adapter:
        if has_option(command, "--preemption-policy"):
            raise ValueError(
                f"refusing to launch {bundle_id!r}: stock vLLM has no --preemption-policy "
                f"option; drop it: the manager hands the policy to the adapter through "
                f"--additional-config"
            )
        return
    plain = without_option(without_option(command, "--preemption-policy"), "--scheduler-cls")
    adapted = shlex.join(["vllm-hust-ext", "run", "--", *plain,
                          "--scheduler-cls", _ADAPTER_SCHEDULER])
    declared = state.configuration(bundle_id).get("protocol_versions")
    first = "" if isinstance(declared, dict) and "vllm.preemption-policy" in declared else (
        f" (first declare the contract version the adapter implements: vllm-hust-ext "
        f"extension configure {bundle_id} --file FILE, FILE holding "
        f'{{"protocol_versions": {{"vllm.preemption-policy": "1.0"}}}})'
    )
    raise ValueError(
        f"refusing to launch {bundle_id!r}: the installed vLLM lacks the "
        f"vllm.preemption-policy contract ({provider.CONTRACT_FILE}), so 'vllm serve' has "
        f"no --preemption-policy flag; name the stock-vLLM adapter and the policy goes "
        f"to it through --additional-config: {adapted}{first}"
    )


def _refuse(
    bundle: InstalledBundle,
    state: State,
    command: Sequence[str],
    peers: Sequence[InstalledBundle],
) -> None:
    """Raise the first §6.2 refusal that applies to this enabled bundle."""
    bundle_id, manifest = bundle.bundle_id, bundle.manifest
    if manifest.activation_blocker is not None:
        raise ValueError(f"refusing to launch {bundle_id!r}: {manifest.activation_blocker}")
    assessed = assess(bundle, state, peers=peers, command=command)
    evidence = "; ".join(assessed["evidence"])
    if "incompatible" in assessed["states"]:
        raise ValueError(f"refusing to launch incompatible extension {bundle_id!r}: {evidence}")
    policy = provider.rendered_options(manifest).get("--preemption-policy")
    if policy and _is_vllm_serve(command):
        _refuse_for_the_host(bundle, state, list(command))
    if assessed["failed_checks"]:
        raise ValueError(
            f"refusing to launch {bundle_id!r}: {'; '.join(assessed['failed_checks'])}"
        )
    if assessed["unhealthy"]:
        raise ValueError(
            f"refusing to launch {bundle_id!r}: required service health is not verified "
            f"({', '.join(assessed['unhealthy'])}); {evidence}"
        )
    if (
        manifest.runtime.isolation == "trusted_in_process"
        and "compatible" not in assessed["states"]
    ):
        raise ValueError(
            f"refusing to launch unverified trusted in-process extension {bundle_id!r}: {evidence}"
        )


def _merged_additional_config(bundles: Sequence[InstalledBundle]) -> dict[str, Any]:
    claims: dict[str, tuple[str, Any]] = {}
    for bundle in bundles:
        for key, value in sorted(bundle.manifest.additional_config.items()):
            _claim(
                claims,
                key,
                bundle.bundle_id,
                value,
                "enabled Bundles disagree on additional_config key {key}",
            )
    return {key: value for key, (_, value) in claims.items()}


def _check_option_conflicts(plans: Sequence[dict[str, Any]]) -> None:
    """§9 (per key): two plans rendering one vLLM option with different values conflict."""
    claims: dict[str, tuple[str, Any]] = {}
    conflict = "extensions '{first}' and '{second}' conflict on {key}"
    for plan_document in plans:
        owner = plan_document["extension_id"]
        generated = plan_document["generated_config"]
        for option, value in sorted(generated.get("vllm_json_options", {}).items()):
            _claim(claims, option, owner, value, conflict)
        for option, value in sorted(generated.get("vllm_options", {}).items()):
            _claim(claims, option, owner, value, conflict)


def _render_options(
    command: list[str], plans: Sequence[dict[str, Any]], skip: frozenset[str] = frozenset()
) -> list[str]:
    _check_option_conflicts(plans)
    for plan_document in plans:
        generated = plan_document["generated_config"]
        for option, value in sorted(generated.get("vllm_json_options", {}).items()):
            command = merge_option(command, option, value, is_json=True)
        for option, value in sorted(generated.get("vllm_options", {}).items()):
            if option not in skip:
                command = merge_option(command, option, value, is_json=False)
        for flag in generated.get("vllm_flags", []):
            command = merge_flag(command, flag)
    return command


def _checked_environment() -> dict[str, str]:
    """`extension env`: the environment `run` would set, after the same cross-bundle
    conflict checks `run` makes (additional_config keys, options, variables), so `env`
    never prints an environment that `run` would refuse for a conflict."""
    state = load_state()
    bundles = list(discover(state.enabled_ids()))
    _merged_additional_config(bundles)
    plans = _plans(bundles, state)
    _check_option_conflicts(plans)
    return activation_environment(plans)


def build_launch(
    raw_command: Sequence[str],
) -> tuple[LaunchPlan, list[InstalledBundle], dict[str, dict[str, Any]]]:
    """The launch, the bundles in it, and each bundle's configuration as the plan read it."""
    state = load_state()
    bundles = list(discover(state.enabled_ids()))
    # §6.2: the refusals (step 2) come before the command is parsed (step 3).
    try:
        command, bad_command = _command(raw_command), None
    except ValueError as error:
        command, bad_command = [], error
    for bundle in bundles:
        _refuse(bundle, state, command, bundles)
    if bad_command is not None:
        raise bad_command
    plans = _plans(bundles, state)
    additional = _merged_additional_config(bundles)
    adapter_policy = _adapter_policy(command, plans)
    if adapter_policy is not None:
        if not same_json(additional.get(_ADAPTER_CONFIG_KEY, adapter_policy), adapter_policy):
            raise ValueError(
                f"an enabled bundle's additional_config key {_ADAPTER_CONFIG_KEY!r} disagrees "
                f"with the policy the stock-vLLM adapter is given ({adapter_policy!r})"
            )
        additional = {**additional, _ADAPTER_CONFIG_KEY: adapter_policy}
    skip = frozenset({"--preemption-policy"}) if adapter_policy is not None else frozenset()
    _refuse_config_file_overlap(command, plans, skip, bool(additional))
    command = merge_additional_config(command, additional)
    command = _render_options(command, plans, skip)
    environment = activation_environment(plans)
    native = {
        p["extension_id"]: p["generated_config"]["native_extension_manifest"]
        for p in plans
        if "native_extension_manifest" in p["generated_config"]
    }
    if native and any(name in os.environ for name in NATIVE_ENVIRONMENT):
        raise ValueError(
            "vllm-hust-ext owns VLLM_EXTENSION_MANIFESTS and VLLM_EXTENSION_BUNDLES while "
            "launching enabled vLLM extensions"
        )
    configurations = {b.bundle_id: state.configuration(b.bundle_id) for b in bundles}
    return LaunchPlan(tuple(command), environment, native), bundles, configurations


def _refuse_config_file_overlap(
    command: list[str], plans: Sequence[dict[str, Any]], skip: frozenset[str],
    additional: bool,
) -> None:
    """vLLM reads a ``--config`` file's options before the command line's, so an option
    that both the file and the extensions set would silently lose the file's value (or,
    for --additional-config, the file's whole object): refused, naming it."""
    from_file = config_file_options(command)
    if not from_file:
        return
    rendered = {"--additional-config"} if additional else set()
    for plan_document in plans:
        generated = plan_document["generated_config"]
        rendered.update(generated.get("vllm_json_options", {}))
        rendered.update(o for o in generated.get("vllm_options", {}) if o not in skip)
        flags = generated.get("vllm_flags", [])
        # A file key "no-<flag>: true" is vLLM's --no-<flag>, which the flag would reverse.
        rendered.update(flags, ("--no-" + flag.removeprefix("--") for flag in flags))
    both = sorted(rendered & from_file)
    if both:
        raise ValueError(
            f"--config {command[command.index('--config') + 1]} sets {', '.join(both)}, "
            f"which the enabled extensions set too; vLLM reads the file before the command "
            f"line, so one would replace the other: give {', '.join(both)} on the command "
            f"line instead"
        )


def _adapter_policy(command: list[str], plans: Sequence[dict[str, Any]]) -> str | None:
    """The policy to hand the stock-vLLM adapter through additional_config when ``command``
    runs the adapter (else ``None``). No host probe here: ``_refuse`` has already refused
    the adapter on a host that has the contract, for every bundle with a policy. Two
    bundles with different policies are refused by ``_render_options``."""
    if not _through_adapter(command):
        return None
    for plan_document in plans:
        policy = plan_document["generated_config"].get("vllm_options", {}).get(
            "--preemption-policy")
        if policy is not None:
            return str(policy)
    return None


def _run(raw_command: Sequence[str], dry_run: bool, grace: float) -> int:
    check_grace(grace)
    launch, bundles, configurations = build_launch(raw_command)
    if dry_run:
        _dump(launch.dry_run_document(), sort_keys=False)
        return 0
    preset = sorted(name for name in EVIDENCE_ENVIRONMENT if name in os.environ)
    if preset:
        raise ValueError(f"vllm-hust-ext owns runtime evidence environment variables: {preset}")
    evidence = launch_environment(
        [(b.bundle_id, b.manifest.extension_version, str(b.manifest_path)) for b in bundles]
    )
    directory = None
    try:
        native_env: dict[str, str] = {}
        if launch.native_manifests:
            directory, native_env = write_native_manifests(launch.native_manifests)
        environment = {**os.environ, **launch.environment, **evidence, **native_env}
        return supervise(launch.command, environment, grace)
    finally:
        remove_directory(directory)
        _shutdown_hooks(bundles, configurations)


def _shutdown_hooks(
    bundles: Sequence[InstalledBundle], configurations: Mapping[str, Mapping[str, Any]]
) -> None:
    """After the launch ended: each bundle's shutdown hook, its report on stderr.

    Signals are ignored meanwhile: the launch is over and its status decided, so a late
    Ctrl-C must neither interrupt a clean-up half way nor change the exit status. For the
    same reason a report line that cannot be written (stderr piped into a ``tee`` that the
    same Ctrl-C ended) is dropped: every hook still runs and the status stays the child's.
    """
    with ignoring_signals():
        for bundle in bundles:
            configuration = configurations[bundle.bundle_id]
            for line in provider.bundle_shutdown(bundle, configuration):
                with contextlib.suppress(OSError, ValueError):  # ValueError: stderr closed
                    print(f"vllm-hust-ext: {bundle.bundle_id}: {line}", file=sys.stderr)


# --- parser -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-hust-ext", description="vLLM-HUST extension manager (compatible)")
    parser.add_argument("--version", action="version", version=f"vllm-hust-ext {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    extension = commands.add_parser("extension", help="manage installed extension bundles")
    verbs = extension.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="list installed bundles")
    listing.add_argument("--json", action="store_true")
    for verb in (
        "inspect",
        "validate",
        "enable",
        "disable",
        "forget",
        "status",
        "check",
        "plan",
        "render",
    ):
        verbs.add_parser(verb).add_argument("extension_id")
    configure = verbs.add_parser("configure")
    configure.add_argument("extension_id")
    configure.add_argument("--file", required=True)
    verbs.add_parser("env")
    run = commands.add_parser("run", help="launch a command with the enabled bundles")
    run.add_argument("--dry-run", action="store_true")
    run.add_argument("--shutdown-grace-seconds", type=float, default=10.0)
    run.add_argument("argv", nargs=argparse.REMAINDER)
    return parser


def _list(as_json: bool) -> None:
    state = load_state()
    bundles, diagnostics = discover_tolerant()
    if as_json:
        documents: list[dict[str, Any]] = [
            inspect_document(b, state.is_enabled(b.bundle_id)) for b in bundles
        ]
        documents += [
            {"bundle_id": d.bundle_id, "discovery_error": d.error, "valid": False}
            for d in diagnostics
        ]
        _dump(documents)
        return
    for bundle in bundles:
        flag = "enabled" if state.is_enabled(bundle.bundle_id) else "disabled"
        print(f"{bundle.bundle_id} {bundle.manifest.extension_version} {flag}")
    for diagnostic in diagnostics:
        print(f"{diagnostic.bundle_id} invalid {diagnostic.error}", file=sys.stderr)


def _text_argument(value: str, what: str) -> None:
    """Refuse an argument made of undecodable bytes (Python's surrogate escapes) before
    anything is read or written: it names no bundle, and echoing it would fail on a strict
    UTF-8 stdout after the state file had already changed."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} {value!r} is not valid UTF-8") from error


def _extension(args: argparse.Namespace) -> None:
    verb = args.verb
    if getattr(args, "extension_id", None) is not None:
        _text_argument(args.extension_id, "extension id")
    if verb == "list":
        _list(args.json)
    elif verb in ("inspect", "validate"):
        bundle = _one(args.extension_id)
        _dump(inspect_document(bundle, load_state().is_enabled(bundle.bundle_id)))
    elif verb == "enable":
        _enable(args.extension_id)
    elif verb == "disable":
        _disable(args.extension_id)
    elif verb == "forget":
        _forget(args.extension_id)
    elif verb in ("status", "check"):
        _status(args.extension_id)
    elif verb == "configure":
        _configure(args.extension_id, args.file)
    elif verb in ("plan", "render"):
        bundle = _one(args.extension_id)
        state = load_state()
        plan_document = _plans([bundle], state)[0]
        _dump(plan_document if verb == "plan" else provider.render(plan_document))
    elif verb == "env":
        _dump(_checked_environment())


def _stdout_reader_left() -> bool:
    """Whether standard output is a pipe whose reader went away (``... | head -1``): the
    write end of such a pipe polls as an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real descriptor: not a pipe's end
        return False


def _end_for_a_reader_that_left() -> int:
    """Stop as a pipeline's writer does when its reader is done: quietly, with the shell's
    status for SIGPIPE. Standard output now points at /dev/null, so the interpreter's last
    flush of what is still buffered cannot fail again on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _flush_stdout() -> None:
    """Flush standard output while a broken pipe can still be told apart from an error."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise
        raise SystemExit(_end_for_a_reader_that_left()) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        _flush_stdout()  # --help and --version leave their text in the buffer
        raise
    try:
        if args.command == "run":
            code = _run(args.argv, args.dry_run, args.shutdown_grace_seconds)
        else:
            _extension(args)
            code = 0
        sys.stdout.flush()  # here, not at exit: a reader that left is found below
        return code
    except BrokenPipeError as error:
        if not _stdout_reader_left():
            parser.error(str(error))
        # What was printed is complete up to where the reader stopped reading; any state
        # change was saved before its line was printed.
        return _end_for_a_reader_that_left()
    except (OSError, ValueError) as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        # Ctrl-C before ``run``'s supervisor took the signal over (a slow bundle check or
        # service probe) or in another verb: nothing was launched; the shell's status for
        # SIGINT, as ``run`` gives when signalled (spec §4), and no traceback.
        return 128 + signal.SIGINT
    except Exception as error:  # never a traceback: the contract is one error line
        parser.error(f"internal error: {type(error).__name__}: {error}")


if __name__ == "__main__":
    sys.exit(main())
