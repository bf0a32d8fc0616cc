"""How a region's Ray cluster runs on Kubernetes: its pods' sizes (one head pod, one worker pod per
GPU), and where the head's GCS keeps its state (``regions/<id>.yaml``, ``kubernetes:``;
terraform/modules/region renders them)."""

import re

from pydantic import Field, field_validator

from serve_app.settings import FrozenSettings

# A Kubernetes object name (DNS-1123 subdomain): a node's, a Secret's.
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class PodSize(FrozenSettings):
    cpus: int = Field(ge=1)
    memory_gib: int = Field(ge=1)


def secret_name(value: str) -> str:
    if not K8S_NAME.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes Secret name (lowercase letters, digits, '-', '.')")
    return value


class GcsRedis(FrozenSettings):
    """The highly available Redis the head's GCS keeps its state in (KubeRay's GCS fault
    tolerance): a head pod lost then restarts alone (its routers with it), the engines on the
    workers live on."""

    address: str = Field(description="host:port of a single-shard Redis (Sentinel, or a managed one) the head reaches.")
    password_secret: str = Field(description="Kubernetes Secret in the region's namespace holding it, key `password`.")

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9.-]+:\d{1,5}$", value):
            raise ValueError(f"{value!r} is not host:port")
        return value

    @field_validator("password_secret")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return secret_name(value)


class RegionKubernetes(FrozenSettings):
    """Sizes of the region's Ray pods: one head pod, one worker pod per GPU; where the GCS keeps
    its state (unset: in the head's memory, which a head loss takes with it)."""

    namespace: str = "serve"
    head: PodSize = PodSize(cpus=4, memory_gib=16)
    gpu_worker: PodSize = PodSize(cpus=12, memory_gib=128)
    gcs_redis: GcsRedis | None = None
