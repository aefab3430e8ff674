"""MkDocs hook: the HTTP API reference page, rendered from the FastAPI app's own OpenAPI document.

The page (``reference/openapi.md``) is generated at build time, so it can never drift from the code: the
app is built around a service object that is never started (no server, no sockets, no sandboxes), and
``app.openapi()`` is rendered as Markdown tables. Everything is offline. The benchmarks' plots
(``bench/results/*.png``) are published under ``img/`` from where the benchmarks write them, not copied.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PAGE = "reference/openapi.md"
METHODS = ("get", "post", "put", "patch", "delete")


def openapi_schema(src: Path) -> dict[str, Any]:
    """The OpenAPI document of the app ``raas serve`` runs, built from the tree at ``src``."""
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    from raas.api.app import create_app
    from raas.pipeline.config import ServiceConfig
    from raas.pipeline.service import RolloutService

    with tempfile.TemporaryDirectory(prefix="raas-docs-") as state_dir:
        # Constructing the service opens nothing that outlives this block; it is never started.
        service = RolloutService(ServiceConfig(state_dir=Path(state_dir) / "state"))
        return create_app(service).openapi()


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def type_of(schema: dict[str, Any]) -> str:
    """A short Markdown spelling of a JSON schema's type, with links to named schemas."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[`{name}`](#{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            parts = [type_of(s) for s in schema[key]]
            return " \\| ".join(dict.fromkeys(parts))
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return f"object of {type_of(extra)}"
        return "object"
    if isinstance(kind, list):
        return " \\| ".join(f"`{k}`" for k in kind)
    if kind:
        fmt = schema.get("format")
        return f"`{kind}`" + (f" ({fmt})" if fmt else "")
    return "any"


def cell(text: Any) -> str:
    """Text safe inside one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        out += [cell(op["summary"]), ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            schema = p.get("schema", {})
            desc = p.get("description") or schema.get("description") or ""
            default = f" (default `{json.dumps(schema['default'])}`)" if "default" in schema else ""
            out.append(
                f"| `{p['name']}` | {p['in']} | {type_of(schema)} | {'yes' if p.get('required') else 'no'} "
                f"| {cell(desc)}{default} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        for ctype, media in body.get("content", {}).items():
            req = "required" if body.get("required") else "optional"
            out += [f"**Request body** ({ctype}, {req}): {type_of(media.get('schema', {}))}", ""]
    out += ["| status | description | body |", "|---|---|---|"]
    for status, resp in sorted(op.get("responses", {}).items()):
        content = resp.get("content", {})
        bodies = ", ".join(f"{type_of(m.get('schema', {}))} ({c})" for c, m in content.items()) or "none"
        out.append(f"| {status} | {cell(resp.get('description', ''))} | {bodies} |")
    out.append("")
    return out


def render_schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [schema["description"].strip(), ""]
    props = schema.get("properties")
    if not props:
        out += [f"Type: {type_of(schema)}", ""]
        return out
    required = set(schema.get("required", []))
    out += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, fs in props.items():
        default = f"`{cell(json.dumps(fs['default']))}`" if "default" in fs else ""
        out.append(
            f"| `{field}` | {type_of(fs)} | {'yes' if field in required else 'no'} | {default} "
            f"| {cell(fs.get('description', ''))} |"
        )
    out.append("")
    return out


def render(spec: dict[str, Any]) -> str:
    """The whole reference page for one OpenAPI document."""
    info = spec.get("info", {})
    out = [
        "# HTTP API reference (generated)",
        "",
        f"Generated at build time from the FastAPI app's OpenAPI document ({info.get('title', '')} "
        f"{info.get('version', '')}, OpenAPI {spec.get('openapi', '')}); a running service serves the same "
        "document at `GET /openapi.json`. The guide to these routes is [HTTP API](http.md); the agent "
        "gateway's routes under `/gateway` are described in [The agent gateway](../gateway.md).",
        "",
        "## Routes",
        "",
    ]
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                out += render_operation(path, method, item[method])
    out += ["## Schemas", ""]
    for name, schema in sorted(spec.get("components", {}).get("schemas", {}).items()):
        out += render_schema(name, schema)
    return "\n".join(out) + "\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    root = Path(config.config_file_path).resolve().parent
    files.append(File.generated(config, PAGE, content=render(openapi_schema(root / "src"))))
    for plot in sorted((root / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"img/{plot.name}", abs_src_path=str(plot)))
    return files
