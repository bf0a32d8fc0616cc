# One cross-region read replica of the key registry (terraform/global/registry.tf), in the AWS
# region of the `aws` provider it is given: its own KMS key, subnet group, security group and
# parameter group there, and the primary's hardening (tests/unit/test_terraform.py compares
# them). Every resource has count = 0 when var.enabled is false (the primary's own region).

locals {
  log_exports = ["postgresql", "upgrade"]
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_region" "current" {}

resource "aws_kms_key" "replica" {
  count = var.enabled ? 1 : 0

  description             = "serve-app key registry (replica ${var.identifier}): storage, Performance Insights, logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountIAMPolicies"
        Effect    = "Allow"
        Principal = { AWS = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root" }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogsForTheReplicaLogGroups"
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

resource "aws_kms_alias" "replica" {
  count = var.enabled ? 1 : 0

  name          = "alias/${var.identifier}"
  target_key_id = aws_kms_key.replica[0].key_id
}

resource "aws_cloudwatch_log_group" "replica" {
  for_each = var.enabled ? toset(local.log_exports) : toset([])

  name              = "/aws/rds/instance/${var.identifier}/${each.key}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.replica[0].arn
  tags              = var.tags
}

resource "aws_db_subnet_group" "replica" {
  count = var.enabled ? 1 : 0

  name        = var.identifier
  description = "serve-app key registry replica: private subnets"
  subnet_ids  = var.network.subnet_ids
  tags        = var.tags
}

# PostgreSQL from the edge sites that read here only; no egress rule.
resource "aws_security_group" "replica" {
  count = var.enabled ? 1 : 0

  name        = var.identifier
  description = "serve-app key registry replica: PostgreSQL from the edge sites only"
  vpc_id      = var.network.vpc_id

  ingress {
    description = "PostgreSQL over TLS from the routers of the edge sites"
    protocol    = "tcp"
    from_port   = 5432
    to_port     = 5432
    cidr_blocks = var.network.client_cidrs
  }

  tags = var.tags
}

resource "aws_db_parameter_group" "replica" {
  count = var.enabled ? 1 : 0

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

resource "aws_db_instance" "replica" {
  count = var.enabled ? 1 : 0
  #checkov:skip=CKV_AWS_226:the engine version is pinned exactly in terraform/global and raised by review, replicas before the primary; RDS upgrading on its own would make the pin drift

  identifier          = var.identifier
  replicate_source_db = var.source_db_arn
  engine_version      = var.engine_version
  instance_class      = var.instance_class
  port                = 5432

  storage_type          = "gp3"
  max_allocated_storage = var.max_allocated_storage_gib
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.replica[0].arn

  iam_database_authentication_enabled = true

  multi_az               = true
  db_subnet_group_name   = aws_db_subnet_group.replica[0].name
  vpc_security_group_ids = [aws_security_group.replica[0].id]
  publicly_accessible    = false
  parameter_group_name   = aws_db_parameter_group.replica[0].name
  ca_cert_identifier     = "rds-ca-rsa2048-g1"

  auto_minor_version_upgrade = false
  maintenance_window         = "sun:07:00-sun:07:30"
  apply_immediately          = false

  # Backups of its own, so that a promoted replica starts with them.
  backup_retention_period  = 14
  backup_window            = "05:00-05:30"
  copy_tags_to_snapshot    = true
  delete_automated_backups = false
  deletion_protection      = true
  # RDS takes no final snapshot of a read replica.
  skip_final_snapshot = true

  enabled_cloudwatch_logs_exports       = local.log_exports
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.replica[0].arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 30
  monitoring_role_arn                   = var.monitoring_role_arn

  tags = var.tags

  depends_on = [aws_cloudwatch_log_group.replica]
}
