"""The Python SDK against docs/openapi.json, the API's one description.

Two checks, with no server: (1) every request the client makes, driven
through its public methods over an ``httpx.MockTransport``, is a documented
method and path, and the answers it parses are instances built from the
documented response schemas; (2) every field a model reads (its wire name)
is a property of its response schema, a field the model requires is required
there, and every field ``DSecContainerRunArgs`` sends is in
``CreateSandboxBody``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import httpx
import pytest

import dsec
from dsec import DSecClient, DSecContainerRunArgs, VolumeMount
from dsec import models

DOC = json.loads((Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text())
SCHEMAS: Dict[str, Any] = DOC["components"]["schemas"]


def resolve(schema: Dict[str, Any]) -> Dict[str, Any]:
    """The schema a ``$ref`` names; an ``allOf`` (an extended schema) as one object schema."""
    while "$ref" in schema:
        schema = SCHEMAS[schema["$ref"].rsplit("/", 1)[-1]]
    if "allOf" in schema:
        merged: Dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for part in map(resolve, schema["allOf"]):
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return merged
    return schema


def example(schema: Dict[str, Any], prefer: Optional[str] = None) -> Any:
    """An instance of ``schema`` with every property set (``prefer``: the union variant of that ``type``)."""
    schema = resolve(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            variants = [resolve(v) for v in schema[key]]
            if prefer is not None:
                for v in variants:
                    if prefer in (v.get("properties", {}).get("type", {}).get("enum") or []):
                        return example(v)
            return example(variants[0])
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object" or "properties" in schema:
        return {name: example(sub) for name, sub in schema.get("properties", {}).items()}
    if kind == "array":
        return [example(schema.get("items", {}))]
    if kind == "integer":
        return 1
    if kind == "number":
        return 1.5
    if kind == "boolean":
        return True
    if schema.get("format") == "date-time":
        return "2026-01-01T00:00:00.000Z"
    if schema.get("format") == "byte":
        return "eA=="
    return "x"


def operations() -> List[Tuple[str, "re.Pattern[str]", Dict[str, Any]]]:
    ops = []
    for path, item in DOC["paths"].items():
        pattern = re.escape(path).replace(r"\{path\}", ".*")
        pattern = re.sub(r"\\\{[A-Za-z_]+\\\}", "[^/]+", pattern)
        for method, op in item.items():
            ops.append((method.upper(), re.compile(f"^{pattern}$"), op))
    return ops


OPERATIONS = operations()


class Recorder:
    """Answers every request from the document; keeps what was asked and what was not described."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.undocumented: List[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        self.calls.append(f"{method} {path}")
        op = next((op for m, p, op in OPERATIONS if m == method and p.match(path)), None)
        if op is None:
            self.undocumented.append(f"{method} {path}")
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "undocumented"}})
        answers = {s: a for s, a in op["responses"].items() if s.startswith("2")}
        # A background command is answered 202 at once; anything else with its first 2xx.
        is_json = request.headers.get("content-type", "").startswith("application/json")
        body = json.loads(request.content) if is_json and request.content else {}
        status = "202" if body.get("background") is True and "202" in answers else next(iter(answers))
        answer = answers[status]
        content = answer.get("content", {})
        accept = request.headers.get("accept", "")
        if "application/x-ndjson" in accept and "application/x-ndjson" in content:
            line = example(content["application/x-ndjson"]["schema"], prefer="result")
            return httpx.Response(int(status), content=json.dumps(line) + "\n",
                                  headers={"content-type": "application/x-ndjson"})
        if "application/json" in content:
            return httpx.Response(int(status), json=example(content["application/json"]["schema"]))
        if "application/octet-stream" in content:
            return httpx.Response(int(status), content=b"bytes",
                                  headers={"content-type": "application/octet-stream"})
        return httpx.Response(int(status))


async def test_every_call_of_the_client_is_a_documented_route(tmp_path: Path) -> None:
    recorder = Recorder()
    client = DSecClient(url="http://dsec.test", api_key="k", max_retries=0)
    await client._http.close()
    client._http._client = httpx.AsyncClient(
        base_url="http://dsec.test", transport=httpx.MockTransport(recorder)
    )
    try:
        await client.open()
        await client.health()
        sandbox = await client.run_container(DSecContainerRunArgs(container_image="busybox"))
        await client.get_sandbox(sandbox.id)
        await client.list_sandboxes(project_id="p", labels={"job": "j"})
        await client.pause_job({"job": "j"})
        await client.resume_job({"job": "j"})
        await client.stop_job({"job": "j"})
        await client.extend_job({"job": "j"}, 60)
        await client.list_images()
        await client.list_images(all=True, project_id="p")
        await client.delete_image("snap:v1", project_id="p")
        await client.create_volume("data", size_mb=64, project_id="p")
        await client.list_volumes()
        await client.list_volumes(project_id="p")
        await client.get_volume("data")
        await client.delete_volume("data", project_id="p")
        await client.create_project("p2", parent_id="p")
        await client.list_projects()
        await client.create_key("p", role="member")
        await client.delete_key("key-1")
        await client.list_edges()
        context = tmp_path / "ctx"
        context.mkdir()
        (context / "Dockerfile").write_text("FROM scratch\n")
        # The document's example build is forever `building`: the wait ends at its deadline.
        with pytest.raises(dsec.DeadlineExceeded):
            await client.build_image(context, name="img", build_args={"A": "1"}, target="t", timeout=0.01,
                                     poll_interval=0)
        await client.get_build("bld-1")
        await client.cancel_build("bld-1")
        await client.fncall.run("python", "print(1)", stdin="", files={"a.py": ""}, args=["x"], env={"K": "v"},
                                timeout_ms=100, memory_mb=64, network=False, max_output_bytes=10,
                                gpu={"mode": "shared"}, edge_selector={"pool": "cpu"})
        # Two calls: the document's example line answers index 1.
        [item async for item in client.fncall.map([{"language": "python", "code": "print(1)"}] * 2)]

        await sandbox.run_shell("echo hi")
        await sandbox.exec(["ls"])
        await sandbox.commands.run("x", on_stdout=lambda _s: None)
        handle = await sandbox.commands.start("x", stdin_open=True)
        await handle.refresh()
        await handle.wait()
        await handle.kill()
        await handle.signal("SIGTERM")
        await handle.send_stdin("data")
        await handle.close_stdin()
        await handle.output(on_stdout=lambda _s: None)
        await sandbox.commands.get("cmd-1")
        await sandbox.commands.list()
        session = sandbox.session("main")
        await session.run("pwd")
        await session.close()
        await sandbox.list_sessions()
        await sandbox.files.write("/a", b"x")
        await sandbox.files.read("/a")
        await sandbox.files.stat("/a")
        await sandbox.files.list("/")
        await sandbox.files.mkdir("/d")
        await sandbox.files.rename("/a", "/b")
        await sandbox.files.remove("/b")
        local = tmp_path / "f"
        await sandbox.files.download("/a", local)
        await sandbox.files.upload(local, "/c")
        await sandbox.refresh()
        await sandbox.update_network_rules(network_rules={"pypi": True})
        await sandbox.events()
        await sandbox.pause()
        await sandbox.resume()
        await sandbox.set_timeout(60)
        await sandbox.snapshot("snap")
        await sandbox.fork(1)
        await sandbox.stop()
    finally:
        await client.close()
    assert recorder.undocumented == []
    # The drive above reached every part of the API the client has.
    assert len(recorder.calls) >= 50


#: Python model → the schema its answer comes in.
MODELS = {
    models.Health: "Health",
    models.Whoami: "Whoami",
    models.SandboxSpec: "SandboxSpec",
    models.SandboxInfo: "SandboxInfo",
    models.CommandResult: "CommandResult",
    models.SessionResult: "SessionResult",
    models.CommandInfo: "CommandInfo",
    models.SessionInfo: "SessionInfo",
    models.FileInfo: "FileInfo",
    models.SandboxEvent: "SandboxEvent",
    models.LayerInfo: "LayerInfo",
    models.SnapshotInfo: "SnapshotInfo",
    models.JobResult: "JobResult",
    models.Project: "Project",
    models.CreatedKey: "CreatedKey",
    models.EdgeStatus: "EdgeStatus",
    models.FnCallResult: "FnCallResult",
    models.VolumeInfo: "VolumeInfo",
}


def _wire_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@pytest.mark.parametrize("model,schema_name", list(MODELS.items()), ids=lambda v: getattr(v, "__name__", v))
def test_model_fields_are_in_the_response_schema(model: type, schema_name: str) -> None:
    schema = resolve(SCHEMAS[schema_name])
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    for field in dataclasses.fields(model):
        wire = _wire_name(field.name)
        assert wire in properties, f"{model.__name__}.{field.name}: no `{wire}` in {schema_name}"
        has_default = (
            field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
        )
        if not has_default:
            assert wire in required, f"{model.__name__}.{field.name} is required but {schema_name}.{wire} is optional"


def test_run_args_fields_are_in_create_sandbox_body() -> None:
    body = resolve(SCHEMAS["CreateSandboxBody"])
    assert body["additionalProperties"] is False, "the server rejects unknown fields"
    # Every field set, so the body carries every key the SDK can send.
    args = DSecContainerRunArgs(
        container_image="busybox",
        memory_limit_mb=512,
        cpu_cores_limit=1.0,
        ttl_running_stop=60,
        network_rules={"pypi": True},
        init_user="root",
        workspace="ws",
        toolkits=["tk"],
        pids_limit=64,
        disk_limit_mb=64,
        qos_class="best-effort",
        network_allow=[{"domain": "example.com"}],
        network_deny=[{"cidr": "10.0.0.0/8"}],
        env={"A": "1"},
        labels={"job": "j"},
        edge_selector={"pool": "gpu"},
        volumes=[VolumeMount("data", "/data"), {"name": "cache", "path": "/cache"}],
        project_id="p",
        request_id="r",
    )
    sent = args.to_body()
    assert sent["volumes"] == [{"name": "data", "path": "/data"}, {"name": "cache", "path": "/cache"}]
    assert len(sent) == len(dataclasses.fields(args)) + 1  # and `backend`
    for key in sent:
        assert key in body["properties"], f"DSecContainerRunArgs sends `{key}`, not in CreateSandboxBody"
    for name in body.get("required", []):
        assert name in sent
