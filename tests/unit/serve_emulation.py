"""What Ray Serve 2.60 does to each deployment when a Serve config is redeployed, decided by Serve's
own code, in this process, without a cluster: the build task's code version and builder
(``_private/application_state.py``, ``build_serve_application``), the config's overrides
(``override_deployment_info``) and the version comparison the deployment state runs on them
(``_private/version.py``, ``DeploymentVersion``). Private APIs: when a Ray upgrade moves them this
helper breaks, and with it the tests that say what a change restarts (docs/operations.md).
"""

import json
from typing import Any
from unittest import mock

from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private import application_state
from ray.serve._private import build_app as build_app_module
from ray.serve._private.application_state import override_deployment_info
from ray.serve._private.build_app import build_app
from ray.serve._private.deploy_utils import deploy_args_to_deployment_info, get_app_code_version, get_deploy_args
from ray.serve._private.version import DeploymentVersion
from ray.serve.schema import ServeDeploySchema

SAME, IN_PLACE, RECONFIGURE, RESTART = "same", "in place", "reconfigure", "restart"


_BUILT: dict[str, dict[tuple[str, str], Any]] = {}


def deployments(config: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """Every deployment of ``config`` as the controller would hold it: (app, deployment) → its
    ``DeploymentInfo`` with the config's options applied. Built once per config's content and
    kept for the session (read-only: building one pickles every deployment's class, ~1.5 s, and
    most tests compare a change with the same deployed config). Serve's HAProxy switch, which a
    test may patch, is part of what it is kept by."""
    key = json.dumps([config, application_state.RAY_SERVE_ENABLE_HA_PROXY, build_app_module.RAY_SERVE_ENABLE_HA_PROXY],
                     sort_keys=True, default=str)
    if key not in _BUILT:
        _BUILT[key] = _build(config)
    return _BUILT[key]


def _build(config: dict[str, Any]) -> dict[tuple[str, str], Any]:
    infos = {}
    with mock.patch("serve_app.app.resolve_model_path", lambda model: model.engine.source or "weights"), \
            mock.patch("ray.get_runtime_context") as context:  # the build task's job id
        context.return_value.get_job_id.return_value = "01000000"
        for app in ServeDeploySchema.model_validate(config).applications:
            code_version = get_app_code_version(app)
            built = build_app(
                call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args),
                name=app.name, default_runtime_env={},
            )
            built_infos = {}
            for deployment in built.deployments:
                ingress = deployment.name == built.ingress_deployment_name
                args = get_deploy_args(
                    name=deployment.name, replica_config=deployment._replica_config, ingress=ingress,
                    deployment_config=deployment._deployment_config, version=code_version,
                    route_prefix=app.route_prefix if ingress else None,
                )
                for unused in ("serialized_autoscaling_policy_def", "serialized_request_router_cls",
                               "serialized_deployment_actors", "uses_multiplexing"):
                    args.pop(unused, None)
                built_infos[deployment.name] = deploy_args_to_deployment_info(app_name=app.name, **args)
            for name, info in override_deployment_info(built_infos, app).items():
                infos[(app.name, name)] = info
    return infos


def _never_runs(info) -> bool:
    autoscaling = info.deployment_config.autoscaling_config
    return autoscaling is not None and autoscaling.min_replicas == 0 == autoscaling.initial_replicas \
        and autoscaling.max_replicas <= 1


def version(info) -> DeploymentVersion:
    """As ``DeploymentTargetState.create`` builds it (``_private/deployment_state.py``)."""
    replica = info.replica_config
    return DeploymentVersion(
        info.version, deployment_config=info.deployment_config, ray_actor_options=replica.ray_actor_options,
        placement_group_bundles=replica.placement_group_bundles, placement_group_strategy=replica.placement_group_strategy,
        max_replicas_per_node=replica.max_replicas_per_node, route_prefix=info.route_prefix,
    )


def what_a_redeploy_does(before: dict[str, Any], after: dict[str, Any]) -> dict[tuple[str, str], str]:
    """Per deployment in both configs: ``restart`` (new replicas replace the running ones),
    ``reconfigure`` (Serve calls the running replicas' ``reconfigure()``), ``in place`` (the
    controller applies the change alone) or ``same``."""
    old, new = deployments(before), deployments(after)
    verdicts = {}
    for key in old.keys() & new.keys():
        if _never_runs(old[key]) and _never_runs(new[key]):
            continue  # a model application's entry (serve_app/app.py ModelEntry): nothing to restart
        was, will = version(old[key]), version(new[key])
        if was.requires_actor_restart(will):
            verdicts[key] = RESTART
        elif was.requires_actor_reconfigure(will):
            verdicts[key] = RECONFIGURE
        elif was != will or old[key].deployment_config != new[key].deployment_config:
            verdicts[key] = IN_PLACE
        else:
            verdicts[key] = SAME
    return verdicts
