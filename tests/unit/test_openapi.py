"""The published /openapi.json: the bodies the router validates and the errors it answers."""

from serve_app.router import ingress
from serve_app.router.openapi import build


def _schema():
    return build(ingress.app)


def test_inference_routes_publish_their_request_bodies():
    schema = _schema()
    for path, model in (("/v1/chat/completions", "ChatCompletionBody"), ("/v1/completions", "CompletionBody")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    chat = schema["components"]["schemas"]["ChatCompletionBody"]
    assert "messages" in chat["required"]
    assert chat["properties"]["n"]["anyOf"][0]["maximum"] == 128
    # Every $ref points at a published component (fuzzers resolve them from the document root).
    refs = []

    def collect(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(schema)
    names = set(schema["components"]["schemas"])
    assert refs and all(ref.removeprefix("#/components/schemas/") in names for ref in refs)


def test_no_route_documents_fastapis_422_and_errors_have_our_shape():
    schema = _schema()
    for operations in schema["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    for status in ("400", "401", "429", "503"):
        assert chat[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(schema["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
