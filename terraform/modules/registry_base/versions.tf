# The provider version is pinned exactly in terraform/global (main.tf); each call passes the
# primary's alias (registry.tf) or a replica module's `aws` (terraform/modules/registry_replica).
terraform {
  required_version = ">= 1.10.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.70.0, < 6.0.0"
    }
  }
}
