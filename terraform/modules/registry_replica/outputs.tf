output "endpoint" {
  description = "host:port of the replica (null when disabled)."
  value       = one(aws_db_instance.replica[*].endpoint)
}

output "arn" {
  description = "ARN of the replica (null when disabled)."
  value       = one(aws_db_instance.replica[*].arn)
}
