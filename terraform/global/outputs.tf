output "global_endpoint" {
  description = "The latency-routed API base URL."
  value       = "https://${var.global_hostname}"
}

output "regions_behind_global_endpoint" {
  description = "GA regions answering for the global name."
  value       = sort(keys(local.ga_regions))
}

output "health_check_ids" {
  description = "Route 53 health check per region (CloudWatch metric HealthCheckStatus)."
  value       = { for id, check in aws_route53_health_check.region : id => check.id }
}
