# GENERATED from regions/*.yaml by `serve-app regions render`.
# Do not edit by hand: the template is serve_app/regions/render.py (_REGISTRY_REPLICA_TF); CI fails on drift.
#
# The key registry's read replicas (registry.tf): one in each distinct AWS region the region
# files name as route53_latency_region, with the edge regions nearest it:
#   ca-central-1: yul-02
#   eu-central-1: fra-01
#   us-west-2: yvr-01
# The one in var.registry_primary_region creates nothing: the edge regions nearest it read the
# primary.
# Terraform cannot iterate over providers, hence an alias of the aws provider main.tf pins and a
# module call per AWS region.

provider "aws" {
  alias  = "ca_central_1"
  region = "ca-central-1"
}

module "registry_replica_ca_central_1" {
  source    = "../modules/registry_replica"
  providers = { aws = aws.ca_central_1 }

  enabled                   = var.registry_primary_region != "ca-central-1"
  identifier                = "${local.registry_identifier}-ca-central-1"
  source_db_arn             = aws_db_instance.registry.arn
  engine_version            = local.registry_engine_version.replicas
  instance_class            = var.registry_instance_class
  max_allocated_storage_gib = var.registry_storage_gib.max
  network                   = try(var.registry_network["ca-central-1"], null)
  monitoring_role_arn       = aws_iam_role.registry_monitoring.arn
  log_retention_days        = var.registry_log_retention_days
  tags                      = local.registry_tags
}

provider "aws" {
  alias  = "eu_central_1"
  region = "eu-central-1"
}

module "registry_replica_eu_central_1" {
  source    = "../modules/registry_replica"
  providers = { aws = aws.eu_central_1 }

  enabled                   = var.registry_primary_region != "eu-central-1"
  identifier                = "${local.registry_identifier}-eu-central-1"
  source_db_arn             = aws_db_instance.registry.arn
  engine_version            = local.registry_engine_version.replicas
  instance_class            = var.registry_instance_class
  max_allocated_storage_gib = var.registry_storage_gib.max
  network                   = try(var.registry_network["eu-central-1"], null)
  monitoring_role_arn       = aws_iam_role.registry_monitoring.arn
  log_retention_days        = var.registry_log_retention_days
  tags                      = local.registry_tags
}

provider "aws" {
  alias  = "us_west_2"
  region = "us-west-2"
}

module "registry_replica_us_west_2" {
  source    = "../modules/registry_replica"
  providers = { aws = aws.us_west_2 }

  enabled                   = var.registry_primary_region != "us-west-2"
  identifier                = "${local.registry_identifier}-us-west-2"
  source_db_arn             = aws_db_instance.registry.arn
  engine_version            = local.registry_engine_version.replicas
  instance_class            = var.registry_instance_class
  max_allocated_storage_gib = var.registry_storage_gib.max
  network                   = try(var.registry_network["us-west-2"], null)
  monitoring_role_arn       = aws_iam_role.registry_monitoring.arn
  log_retention_days        = var.registry_log_retention_days
  tags                      = local.registry_tags
}

locals {
  # host:port of the replica in each AWS region (null in the primary's): outputs.tf.
  registry_replica_endpoints = {
    "ca-central-1" = module.registry_replica_ca_central_1.endpoint
    "eu-central-1" = module.registry_replica_eu_central_1.endpoint
    "us-west-2"    = module.registry_replica_us_west_2.endpoint
  }
}
