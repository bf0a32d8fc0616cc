variable "dns_zone" {
  description = "The public hosted zone of the edge endpoints (generated)."
  type        = string
}

variable "global_hostname" {
  description = "The latency-routed name in front of every GA region (generated)."
  type        = string
}

# --- the key registry (registry.tf, registry_replicas.tf) --------------------------------------

variable "registry_primary_region" {
  description = "AWS region of the key registry's primary. Edge regions whose route53_latency_region it is read the primary; every other one reads its nearest replica."
  type        = string
  default     = "ca-central-1"
}

variable "registry_network" {
  description = "Set by the operator (registry_network.tfvars.example), one entry per AWS region holding a registry instance (the primary's and each replica's): the VPC, its private subnets (two AZs at least) and the CIDRs of the edge sites whose routers connect there. The primary takes every entry's CIDRs: every region writes to it."
  type = map(object({
    vpc_id       = string
    subnet_ids   = list(string)
    client_cidrs = list(string)
  }))

  validation {
    condition     = contains(keys(var.registry_network), var.registry_primary_region)
    error_message = "registry_network needs an entry for registry_primary_region."
  }

  validation {
    condition     = alltrue([for net in values(var.registry_network) : length(net.subnet_ids) >= 2])
    error_message = "Every registry_network entry needs private subnets in two availability zones at least (Multi-AZ)."
  }

  validation {
    condition = alltrue(flatten([
      for net in values(var.registry_network) : [
        for cidr in net.client_cidrs : can(cidrnetmask(cidr)) && !endswith(cidr, "/0")
      ]
    ]))
    error_message = "client_cidrs are the edge sites' IPv4 CIDRs: never /0."
  }
}

variable "registry_instance_class" {
  description = "DB instance class of the registry's primary and of every replica."
  type        = string
  default     = "db.m7g.large"
}

variable "registry_storage_gib" {
  description = "The primary's gp3 storage: allocated at creation, and the ceiling of storage autoscaling."
  type        = object({ allocated = number, max = number })
  default     = { allocated = 100, max = 1000 }
}

variable "registry_log_retention_days" {
  description = "Retention of the registry instances' PostgreSQL and upgrade logs in CloudWatch."
  type        = number
  default     = 365
}
