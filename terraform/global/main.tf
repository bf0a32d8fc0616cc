# The global layer: one name, api.edge.polargrid.ai, answered by Route 53 latency routing with the
# nearest healthy GA region that is not draining (global_name.tf), and an HTTPS health check on
# every region's /health (pilot and draining regions too: they are failover peers and SREs watch
# them). generated.auto.tfvars.json lists the regions
# (rendered from regions/ by `python -m serve_app.regions.cli render`).
#
# Each region's own name (api.<id>.edge.polargrid.ai) points at that region's ingress and is
# managed with the region's site, not here.
#
# The key registry every region shares, on RDS for PostgreSQL, is here too: the primary
# (registry.tf) and a read replica in each edge region's nearest AWS region (registry_replicas.tf,
# rendered from regions/ like generated.auto.tfvars.json).

terraform {
  required_version = ">= 1.10.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "5.100.0"
    }
  }

  # Partial configuration: `terraform init -backend-config=../backend.hcl`.
  backend "s3" {
    key = "serve-app/global.tfstate"
  }
}

# Route 53 is global; its health-check metrics live in us-east-1. IAM is global too.
provider "aws" {
  region = "us-east-1"
}

# The key registry's primary (registry.tf). Every alias of this file and of
# registry_replicas.tf is the aws provider pinned above.
provider "aws" {
  alias  = "registry_primary"
  region = var.registry_primary_region
}

data "aws_route53_zone" "edge" {
  name = var.dns_zone
}

resource "aws_route53_health_check" "region" {
  for_each = var.regions

  # /health is 503 while the region's main model (region_health: required) serves on no replica,
  # even if its embedding model does, and while its routers cannot read the key registry
  # (docs/reliability.md, "What /health says").
  type              = "HTTPS"
  fqdn              = each.value.endpoint_host
  port              = 443
  resource_path     = "/health"
  enable_sni        = true
  request_interval  = 10
  failure_threshold = 3
  measure_latency   = true
  # Checkers on three continents agree before a region is marked down.
  regions = ["us-east-1", "us-west-2", "eu-west-1"]

  tags = {
    Name     = "serve-app-${each.key}"
    region   = each.key
    location = each.value.location
  }
}

resource "aws_route53_record" "global" {
  for_each = local.global_name_regions

  zone_id        = data.aws_route53_zone.edge.zone_id
  name           = var.global_hostname
  type           = "CNAME"
  ttl            = 60
  records        = [each.value.endpoint_host]
  set_identifier = each.key

  latency_routing_policy {
    region = each.value.route53_latency_region
  }

  # An unhealthy region drops out of the answers until its /health passes again.
  health_check_id = aws_route53_health_check.region[each.key].id
}
