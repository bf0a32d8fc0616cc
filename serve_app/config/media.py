"""A model's media policy: which images, audio and video its requests may carry, and what the
engine may fetch (docs/regions.md, "Media"; the router's check: serve_app/router/media.py)."""

import ipaddress
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from serve_app.settings import Settings, listed_twice

# With media off the engine still gets --allowed-media-domains, naming only this host: `.invalid`
# never resolves (RFC 6761), so an image URL that got past the router is refused by vLLM
# before any fetch (an empty list would mean "every host" to vLLM).
MEDIA_OFF_HOST = "media-off.invalid"
# vLLM flags the media policy sets (or keeps unset): extra_args may not override them.
MEDIA_FLAGS = ("allowed-media-domains", "allowed-local-media-path")
# The replica's environment whatever the config: vLLM follows a media URL's redirects by
# default, and an allowed host could redirect into the cluster.
ENGINE_ENV = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)+[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Names that resolve inside a cluster or a host, never to a public media server.
_INTERNAL_SUFFIXES = (".local", ".localhost", ".internal", ".svc", ".invalid", ".test", ".example", ".arpa")


class MediaPolicy(Settings):
    """Which media (images, audio, video) a model's requests may carry (docs/regions.md, "Media").

    ``off`` (the default, and ``media: off`` in YAML): the router refuses every content part that
    is not text (400 ``media_not_allowed``) and the engine fetches nothing (``MEDIA_OFF_HOST``).
    ``allowed_domains``: image, audio and video parts may name an http(s) URL whose host is exactly
    one of these (vLLM's own comparison: no subdomains, no wildcards), or carry the media inline
    (a base64 ``data:`` URL); the engine gets the same list as ``--allowed-media-domains``.
    """

    allowed_domains: tuple[str, ...] = Field(
        (), description="Hosts media URLs may name, exactly; empty: media off.", max_length=64
    )

    @model_validator(mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false.
        if value is False or value == "off":
            return {}
        if value is True or value == "on":
            raise ValueError("media is 'off' or {allowed_domains: [host, ...]}: name the hosts media may come from")
        return value

    @field_validator("allowed_domains")
    @classmethod
    def _public_hostnames(cls, domains: tuple[str, ...]) -> tuple[str, ...]:
        for domain in domains:
            if _is_ip(domain):
                raise ValueError(f"{domain!r}: name a host, not an IP address")
            if not _HOSTNAME.match(domain):
                raise ValueError(f"{domain!r} is not a lower-case host name like cdn.example.com (no scheme, port or path)")
            if domain.endswith(_INTERNAL_SUFFIXES):
                raise ValueError(f"{domain!r} is a cluster- or host-internal name; media must come from public hosts")
        if twice := listed_twice(domains):
            raise ValueError(f"listed twice: {', '.join(twice)}")
        return domains

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def engine_domains(self) -> list[str]:
        """``--allowed-media-domains``: the allow-list, or with media off a host that never resolves."""
        return list(self.allowed_domains) or [MEDIA_OFF_HOST]


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return False
    return True
