variable "enabled" {
  description = "false where this AWS region is the primary's: the module then creates nothing, and the edge regions nearest it read the primary."
  type        = bool
}

variable "identifier" {
  description = "DB instance identifier of the replica (also names its key, groups and log groups)."
  type        = string
}

variable "source_db_arn" {
  description = "ARN of the registry's primary (a cross-region replica names its source by ARN)."
  type        = string
}

variable "engine_version" {
  description = "Exact PostgreSQL version of the replica: the primary's, or newer while a minor upgrade rolls out (replicas first)."
  type        = string
}

variable "instance_class" {
  description = "DB instance class of the replica."
  type        = string
}

variable "max_allocated_storage_gib" {
  description = "Ceiling of the replica's storage autoscaling: the primary's, so a growing primary never fills its replica."
  type        = number
}

variable "network" {
  description = "The VPC, its private subnets and the edge sites' CIDRs in this AWS region (the global layer's var.registry_network entry); null only when disabled."
  type = object({
    vpc_id       = string
    subnet_ids   = list(string)
    client_cidrs = list(string)
  })

  validation {
    condition     = !var.enabled || var.network != null
    error_message = "registry_network has no entry for this replica's AWS region (see registry_network.tfvars.example)."
  }
}

variable "monitoring_role_arn" {
  description = "The enhanced-monitoring IAM role (global, shared with the primary)."
  type        = string
}

variable "log_retention_days" {
  description = "Retention of the replica's exported PostgreSQL and upgrade logs."
  type        = number
}

variable "tags" {
  description = "Tags of every resource."
  type        = map(string)
}
