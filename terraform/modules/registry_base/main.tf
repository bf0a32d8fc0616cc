# What one key-registry instance (terraform/global/registry.tf's primary, or a
# terraform/modules/registry_replica) needs in its AWS region, the region of the `aws` provider
# it is given: a KMS key, the log groups RDS exports to, a subnet group and the parameter group.
# Written once, so the primary and every replica share them. The DB instance stays with the
# caller (a primary and a read replica differ there), and must depend on this module, so its
# log groups exist, encrypted and kept, before RDS writes to them.
#
# The security group stays with the caller too, beside the instance it is attached to: checkov
# links a module's outputs to its first instance only when the module is nested (this one in
# every registry_replica), so CKV2_AWS_5 would find the other replicas' groups unattached.

locals {
  log_exports = ["postgresql", "upgrade"]
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

resource "aws_kms_key" "registry" {
  description             = var.kms_key_description
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        # The account's IAM policies decide who uses the key (RDS and Secrets Manager act
        # through grants made with the caller's permissions).
        Sid       = "AccountIAMPolicies"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogsForTheRegistryLogGroups"
        Effect    = "Allow"
        Principal = { Service = "logs.${data.aws_region.current.name}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnLike = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${data.aws_partition.current.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:/aws/rds/instance/${var.identifier}/*"
          }
        }
      },
    ]
  })

  tags = var.tags
}

resource "aws_kms_alias" "registry" {
  name          = "alias/${var.identifier}"
  target_key_id = aws_kms_key.registry.key_id
}

# RDS writes the exported logs here; created first, so they are encrypted and kept.
resource "aws_cloudwatch_log_group" "registry" {
  for_each = toset(local.log_exports)

  name              = "/aws/rds/instance/${var.identifier}/${each.key}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.registry.arn
  tags              = var.tags
}

resource "aws_db_subnet_group" "registry" {
  name        = var.identifier
  description = "serve-app key registry ${var.role}: private subnets"
  subnet_ids  = var.subnet_ids
  tags        = var.tags
}

# TLS forced (1.2 at least); DDL and statements slower than 1 s logged.
resource "aws_db_parameter_group" "registry" {
  name        = "${var.identifier}-postgres16"
  family      = "postgres16"
  description = "serve-app key registry: TLS only, DDL and slow statements logged"

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "ssl_min_protocol_version"
    value = "TLSv1.2"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }

  tags = var.tags

  lifecycle {
    create_before_destroy = true
  }
}
