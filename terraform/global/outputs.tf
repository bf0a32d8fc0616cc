output "global_endpoint" {
  description = "The latency-routed API base URL."
  value       = "https://${var.global_hostname}"
}

output "regions_behind_global_endpoint" {
  description = "GA regions the global name answers with (not draining)."
  value       = sort(keys(local.global_name_regions))
}

output "health_check_ids" {
  description = "Route 53 health check per region (CloudWatch metric HealthCheckStatus)."
  value       = { for id, check in aws_route53_health_check.region : id => check.id }
}

output "registry_primary_endpoint" {
  description = "host:port of the key registry's primary (TF_VAR_registry_dsn of every region)."
  value       = aws_db_instance.registry.endpoint
}

output "registry_read_endpoints" {
  description = "Per edge region id, host:port its routers read from (TF_VAR_registry_read_dsn): the replica in its route53_latency_region, or the primary when that is the primary's region."
  value = {
    for id, region in var.regions : id => (
      region.route53_latency_region == var.registry_primary_region
      ? aws_db_instance.registry.endpoint
      : local.registry_replica_endpoints[region.route53_latency_region]
    )
  }
}

output "registry_master_user_secret_arn" {
  description = "ARN of the Secrets Manager secret holding the master user's password (managed and rotated by RDS)."
  value       = aws_db_instance.registry.master_user_secret[0].secret_arn
}
