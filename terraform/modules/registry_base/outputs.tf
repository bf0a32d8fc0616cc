output "kms_key_arn" {
  description = "The instance's KMS key: storage, Performance Insights (and the primary's master secret)."
  value       = aws_kms_key.registry.arn
}

output "log_exports" {
  description = "The logs the instance exports to CloudWatch (enabled_cloudwatch_logs_exports)."
  value       = local.log_exports
}

output "db_subnet_group_name" {
  value = aws_db_subnet_group.registry.name
}

output "parameter_group_name" {
  value = aws_db_parameter_group.registry.name
}
