# Which regions Route 53 answers api.edge.polargrid.ai with: GA regions that are not draining.
# The choice is rendered (Region.behind_global_name in serve_app/regions/schema.py) and nothing
# here declares a provider, so tests/unit/test_terraform.py applies this file alone, offline.
#
# A pilot region is reached at its own endpoint by the customers of its pilot. A draining GA
# region (`draining: true`, docs/operations.md "Draining a region") loses its latency record
# only: its health check, its ingress (which still answers for the global name, for resolvers
# that cached it) and its peers' failover stay.

variable "regions" {
  description = "Every region, from regions/<id>.yaml (generated.auto.tfvars.json)."
  type = map(object({
    location               = string
    status                 = string
    behind_global_name     = bool
    endpoint_host          = string
    route53_latency_region = string
  }))

  validation {
    condition     = alltrue([for region in values(var.regions) : contains(["pilot", "ga"], region.status)])
    error_message = "A region's status is pilot or ga."
  }

  validation {
    condition     = alltrue([for region in values(var.regions) : region.status == "ga" || !region.behind_global_name])
    error_message = "Only a GA region can be behind the global name."
  }
}

locals {
  global_name_regions = { for id, region in var.regions : id => region if region.behind_global_name }
}
