"""Serve's status as ``serve.status()`` returns it (Ray 2.60's own dataclasses and enums) and as the
``serve status`` CLI prints it (the same, through the CLI's YAML dumper), built without a cluster."""

from dataclasses import asdict
from typing import Any

import yaml
from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus
from ray.serve.scripts import ServeDeploySchemaDumper, process_dict_for_yaml_dump


def status_of(apps: dict[str, tuple[str, float, dict[str, dict[str, int]]]]) -> ServeStatus:
    """A ServeStatus of ``apps``: name -> (application status, last deployed, {deployment: replicas
    by state})."""
    return ServeStatus(target_capacity=None, applications={
        name: ApplicationStatusOverview(
            status=ApplicationStatus(app_status), message="", last_deployed_time_s=deployed,
            deployments={
                deployment: DeploymentStatusOverview(
                    status=DeploymentStatus.HEALTHY, status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_COMPLETED,
                    replica_states={ReplicaState(state): n for state, n in replicas.items()}, message="")
                for deployment, replicas in deployments.items()})
        for name, (app_status, deployed, deployments) in apps.items()})


def as_printed(status: ServeStatus) -> dict[str, Any]:
    """What ``serve status`` prints for ``status``, read back as YAML (``serve_cli.serve_status``)."""
    printed = yaml.dump(process_dict_for_yaml_dump(asdict(status)), Dumper=ServeDeploySchemaDumper, sort_keys=False)
    return yaml.safe_load(printed)
