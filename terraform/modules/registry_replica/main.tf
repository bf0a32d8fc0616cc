# One cross-region read replica of the key registry (terraform/global/registry.tf), in the AWS
# region of the `aws` provider it is given: its own KMS key, log groups, subnet group and
# parameter group there (terraform/modules/registry_base, as the primary's), its own security
# group, and the primary's hardening (tests/unit/test_terraform.py compares them). Every resource
# and module call has count = 0 when var.enabled is false (the primary's own region).

# The replica's KMS key, log groups, subnet group and parameter group, as the primary's
# (terraform/modules/registry_base), in this provider's AWS region.
module "registry_base" {
  source = "../registry_base"
  count  = var.enabled ? 1 : 0

  identifier          = var.identifier
  role                = "replica"
  kms_key_description = "serve-app key registry (replica ${var.identifier}): storage, Performance Insights, logs"
  subnet_ids          = var.network.subnet_ids
  log_retention_days  = var.log_retention_days
  tags                = var.tags
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
  kms_key_id            = module.registry_base[0].kms_key_arn

  iam_database_authentication_enabled = true

  multi_az               = true
  db_subnet_group_name   = module.registry_base[0].db_subnet_group_name
  vpc_security_group_ids = [aws_security_group.replica[0].id]
  publicly_accessible    = false
  parameter_group_name   = module.registry_base[0].parameter_group_name
  ca_cert_identifier     = "rds-ca-rsa2048-g1"

  auto_minor_version_upgrade = false
  # An hour before the primary's (terraform/global/registry.tf): RDS wants a primary's read
  # replicas upgraded before it, and an engine upgrade applied in the next windows (both pins
  # raised in one week) runs in window order. And a Multi-AZ instance's OS maintenance fails it
  # over (a minute or two unreachable): a router whose replica is away reads the primary
  # (serve_app/auth/database.py), so the two should not be away together — with one window for
  # all, every region's uncached lookups could be refused at once.
  maintenance_window = "sun:06:00-sun:06:30"
  apply_immediately  = false

  # Backups of its own, so that a promoted replica starts with them.
  backup_retention_period  = 14
  backup_window            = "05:00-05:30"
  copy_tags_to_snapshot    = true
  delete_automated_backups = false
  deletion_protection      = true
  # RDS takes no final snapshot of a read replica.
  skip_final_snapshot = true

  enabled_cloudwatch_logs_exports       = module.registry_base[0].log_exports
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = module.registry_base[0].kms_key_arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 30
  monitoring_role_arn                   = var.monitoring_role_arn

  tags = var.tags

  depends_on = [module.registry_base]
}
