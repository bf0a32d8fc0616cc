variable "identifier" {
  description = "DB instance identifier of the registry instance (also names its key, groups and log groups)."
  type        = string
}

variable "role" {
  description = "primary or replica: named in the subnet group's description."
  type        = string

  validation {
    condition     = contains(["primary", "replica"], var.role)
    error_message = "role is primary or replica."
  }
}

variable "kms_key_description" {
  description = "Description of the instance's KMS key: what it encrypts."
  type        = string
}

variable "subnet_ids" {
  description = "The private subnets of the instance in this AWS region (two AZs at least: Multi-AZ)."
  type        = list(string)
}

variable "log_retention_days" {
  description = "Retention of the instance's exported PostgreSQL and upgrade logs."
  type        = number
}

variable "tags" {
  description = "Tags of every resource."
  type        = map(string)
}
