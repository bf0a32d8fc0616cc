# The key registry every region shares (API keys, revocations, the usage ledger, token budgets;
# docs/auth.md, "Registry"): one RDS for PostgreSQL primary in var.registry_primary_region, and
# a read replica in each edge region's nearest AWS region (registry_replicas.tf, rendered;
# terraform/modules/registry_replica, with the same hardening as here). Routers write to the
# primary and read from their nearest instance (docs/regions.md, "The key registry database").
#
# Network facts (VPC, private subnets, the edge sites' CIDRs) come from var.registry_network,
# which the operator sets (registry_network.tfvars.example). The master password never leaves
# RDS and Secrets Manager (manage_master_user_password); no output carries a password.

locals {
  registry_identifier = "serve-app-registry"

  # Exact pins, changed by review. A minor upgrade raises `replicas` first (apply), then
  # `primary` (apply): RDS wants a primary's read replicas upgraded before the primary.
  registry_engine_version = {
    primary  = "16.11"
    replicas = "16.11"
  }

  registry_log_exports     = ["postgresql", "upgrade"]
  registry_primary_network = var.registry_network[var.registry_primary_region]
  # Every edge region writes to the primary: it takes every site's CIDRs.
  registry_client_cidrs = sort(distinct(flatten([for net in values(var.registry_network) : net.client_cidrs])))

  registry_tags = {
    service   = "serve-app"
    component = "key-registry"
    managed   = "terraform"
  }
}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

# Storage, Performance Insights, the master password's secret and the log groups of the primary.
resource "aws_kms_key" "registry" {
  provider = aws.registry_primary

  description             = "serve-app key registry (primary): storage, Performance Insights, master secret, logs"
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
        Principal = { Service = "logs.${var.registry_primary_region}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnLike = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${data.aws_partition.current.partition}:logs:${var.registry_primary_region}:${data.aws_caller_identity.current.account_id}:log-group:/aws/rds/instance/${local.registry_identifier}/*"
          }
        }
      },
    ]
  })

  tags = local.registry_tags
}

resource "aws_kms_alias" "registry" {
  provider = aws.registry_primary

  name          = "alias/${local.registry_identifier}"
  target_key_id = aws_kms_key.registry.key_id
}

# RDS writes the exported logs here; created first, so they are encrypted and kept a year.
resource "aws_cloudwatch_log_group" "registry" {
  provider = aws.registry_primary
  for_each = toset(local.registry_log_exports)

  name              = "/aws/rds/instance/${local.registry_identifier}/${each.key}"
  retention_in_days = var.registry_log_retention_days
  kms_key_id        = aws_kms_key.registry.arn
  tags              = local.registry_tags
}

resource "aws_db_subnet_group" "registry" {
  provider = aws.registry_primary

  name        = local.registry_identifier
  description = "serve-app key registry primary: private subnets"
  subnet_ids  = local.registry_primary_network.subnet_ids
  tags        = local.registry_tags
}

# PostgreSQL from the edge sites only; no egress rule (RDS replicates outside security groups).
resource "aws_security_group" "registry" {
  provider = aws.registry_primary

  name        = local.registry_identifier
  description = "serve-app key registry primary: PostgreSQL from the edge sites only"
  vpc_id      = local.registry_primary_network.vpc_id

  ingress {
    description = "PostgreSQL over TLS from the routers of the edge sites"
    protocol    = "tcp"
    from_port   = 5432
    to_port     = 5432
    cidr_blocks = local.registry_client_cidrs
  }

  tags = local.registry_tags
}

# TLS forced (1.2 at least); DDL and statements slower than 1 s logged. The replicas' parameter
# group (terraform/modules/registry_replica) sets the same (tests/unit/test_terraform.py).
resource "aws_db_parameter_group" "registry" {
  provider = aws.registry_primary

  name        = "${local.registry_identifier}-postgres16"
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

  tags = local.registry_tags

  lifecycle {
    create_before_destroy = true
  }
}

# Enhanced monitoring's role, for the primary and every replica (IAM is global).
resource "aws_iam_role" "registry_monitoring" {
  name        = "${local.registry_identifier}-monitoring"
  description = "RDS enhanced monitoring of the serve-app key registry"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "monitoring.rds.amazonaws.com" }
      Action    = "sts:AssumeRole"
      Condition = { StringEquals = { "aws:SourceAccount" = data.aws_caller_identity.current.account_id } }
    }]
  })
  tags = local.registry_tags
}

resource "aws_iam_role_policy_attachment" "registry_monitoring" {
  role       = aws_iam_role.registry_monitoring.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "registry" {
  provider = aws.registry_primary
  #checkov:skip=CKV_AWS_226:the engine version is pinned exactly and raised by review (replicas first, local.registry_engine_version); RDS upgrading on its own would make the pin drift and the replicas lag the primary

  identifier     = local.registry_identifier
  engine         = "postgres"
  engine_version = local.registry_engine_version.primary
  instance_class = var.registry_instance_class
  port           = 5432

  storage_type          = "gp3"
  allocated_storage     = var.registry_storage_gib.allocated
  max_allocated_storage = var.registry_storage_gib.max
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.registry.arn

  # The master user's password is generated by RDS and kept (and rotated) in Secrets Manager,
  # encrypted with the registry's key. The application's own role is created by the operator
  # (docs/regions.md).
  username                            = "registry_admin"
  manage_master_user_password         = true
  master_user_secret_kms_key_id       = aws_kms_key.registry.arn
  iam_database_authentication_enabled = true

  multi_az               = true
  db_subnet_group_name   = aws_db_subnet_group.registry.name
  vpc_security_group_ids = [aws_security_group.registry.id]
  publicly_accessible    = false
  parameter_group_name   = aws_db_parameter_group.registry.name
  ca_cert_identifier     = "rds-ca-rsa2048-g1"

  auto_minor_version_upgrade = false
  maintenance_window         = "sun:07:00-sun:07:30"
  apply_immediately          = false

  # 14 days of backups; read replicas need them on their source.
  backup_retention_period   = 14
  backup_window             = "05:00-05:30"
  copy_tags_to_snapshot     = true
  delete_automated_backups  = false
  deletion_protection       = true
  skip_final_snapshot       = false
  final_snapshot_identifier = "${local.registry_identifier}-final"

  enabled_cloudwatch_logs_exports       = local.registry_log_exports
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = aws_kms_key.registry.arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 30
  monitoring_role_arn                   = aws_iam_role.registry_monitoring.arn

  tags = local.registry_tags

  depends_on = [aws_cloudwatch_log_group.registry, aws_iam_role_policy_attachment.registry_monitoring]

  lifecycle {
    precondition {
      condition = (
        split(".", local.registry_engine_version.replicas)[0] == split(".", local.registry_engine_version.primary)[0]
        && tonumber(split(".", local.registry_engine_version.replicas)[1]) >= tonumber(split(".", local.registry_engine_version.primary)[1])
      )
      error_message = "The replicas' engine version must be the primary's major version, at the primary's minor version or newer: upgrade the replicas first."
    }
  }
}
