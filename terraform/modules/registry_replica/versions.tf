# The provider version is pinned exactly in terraform/global (main.tf); each call passes one of
# its region aliases as this module's `aws` (registry_replicas.tf).
terraform {
  required_version = ">= 1.10.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.70.0, < 6.0.0"
    }
  }
}
