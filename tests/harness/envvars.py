"""Container environment as kubelet builds it: `$(VAR)` expansion and `valueFrom` resolution.

The process-backed nodes run container commands as host processes; to behave like a real node
they must hand each process the same environment kubelet would. Everything here is pure: API
lookups (Secrets, ConfigMaps) are passed in as callables so unit tests need no cluster.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

JsonObject = dict[str, Any]
KeyLookup = Callable[[str, str], str | None]
"""(object name, key) -> value, or None when the object or key does not exist."""


class EnvResolutionError(Exception):
    """A referenced ConfigMap/Secret/field is missing (kubelet: CreateContainerConfigError)."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand `$(NAME)` references the way kubelet does (third_party/forked/golang/expansion).

    `$$` is an escaped `$`; a reference to an undefined variable, or an unterminated `$(`, is
    left as written.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            advance = 1
            if rest[0] == "$":
                out.append("$")
            elif rest[0] == "(":
                closer = rest.find(")", 1)
                if closer == -1:
                    out.append("$(")
                else:
                    name = rest[1:closer]
                    out.append(variables.get(name, f"$({name})"))
                    advance = closer + 1
            else:
                out.append("$" + rest[0])
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['(?P<key>[^']+)'\]$")


def field_ref_value(pod: JsonObject, field_path: str, pod_ip: str, host_ip: str) -> str:
    """Value of a downward-API `fieldRef.fieldPath` for this pod."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple: dict[str, str] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if field_path in simple:
        return simple[field_path]
    match = _LABEL_PATH.match(field_path)
    if match:
        return str(meta.get(match.group(1), {}).get(match.group("key"), ""))
    raise EnvResolutionError(f"unsupported fieldRef.fieldPath {field_path!r}")


def resolve_container_env(
    pod: JsonObject,
    container: JsonObject,
    *,
    pod_ip: str,
    host_ip: str,
    config_map_key: KeyLookup,
    secret_key: KeyLookup,
) -> dict[str, str]:
    """The variables a container's `env` defines, in kubelet's order and with its expansion.

    Each `value` may refer to variables defined earlier in the list. `envFrom` is applied first
    (as kubelet does), then `env` entries override it.
    """
    resolved: dict[str, str] = {}
    for source in container.get("envFrom", []) or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref = source["configMapRef"]
            data = _whole_object(config_map_key, ref["name"], ref.get("optional", False))
        elif "secretRef" in source:
            ref = source["secretRef"]
            data = _whole_object(secret_key, ref["name"], ref.get("optional", False))
        else:
            continue
        resolved.update({prefix + key: value for key, value in data.items()})
    for entry in container.get("env", []) or []:
        name = entry["name"]
        if "valueFrom" in entry:
            value = _value_from(
                entry["valueFrom"], pod, pod_ip, host_ip, config_map_key, secret_key
            )
            if value is None:
                continue
            resolved[name] = value
        else:
            resolved[name] = expand(entry.get("value", ""), resolved)
    return resolved


def _whole_object(lookup: KeyLookup, name: str, optional: bool) -> dict[str, str]:
    """envFrom needs every key; the lookup with key '' returns the JSON of the whole data map."""
    import json

    raw = lookup(name, "")
    if raw is None:
        if optional:
            return {}
        raise EnvResolutionError(f"envFrom object {name!r} not found")
    data: dict[str, str] = json.loads(raw)
    return data


def _value_from(
    value_from: JsonObject,
    pod: JsonObject,
    pod_ip: str,
    host_ip: str,
    config_map_key: KeyLookup,
    secret_key: KeyLookup,
) -> str | None:
    if "fieldRef" in value_from:
        return field_ref_value(pod, value_from["fieldRef"]["fieldPath"], pod_ip, host_ip)
    for kind, lookup in (("configMapKeyRef", config_map_key), ("secretKeyRef", secret_key)):
        if kind in value_from:
            ref = value_from[kind]
            value = lookup(ref["name"], ref["key"])
            if value is None:
                if ref.get("optional", False):
                    return None
                raise EnvResolutionError(f"{kind} {ref['name']}/{ref['key']} not found")
            return value
    if "resourceFieldRef" in value_from:
        return _resource_field(value_from["resourceFieldRef"], pod)
    raise EnvResolutionError(f"unsupported valueFrom {sorted(value_from)}")


def _resource_field(ref: JsonObject, pod: JsonObject) -> str:
    """Best effort for resourceFieldRef: the raw quantity string of the named container."""
    containers = pod.get("spec", {}).get("containers", [])
    name = ref.get("containerName")
    container = next((c for c in containers if c.get("name") == name), containers[0])
    kind, _, resource = ref["resource"].partition(".")
    return str(container.get("resources", {}).get(kind, {}).get(resource, "0"))


def expand_command(
    command: Sequence[str] | None, args: Sequence[str] | None, env: Mapping[str, str]
) -> list[str]:
    """The argv kubelet runs: `command + args` with `$(VAR)` expanded from the container env."""
    return [expand(part, env) for part in [*(command or []), *(args or [])]]
