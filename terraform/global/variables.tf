variable "dns_zone" {
  description = "The public hosted zone of the edge endpoints (generated)."
  type        = string
}

variable "global_hostname" {
  description = "The latency-routed name in front of every GA region (generated)."
  type        = string
}

variable "regions" {
  description = "Every region, from regions/<id>.yaml (generated.auto.tfvars.json)."
  type = map(object({
    location               = string
    status                 = string
    endpoint_host          = string
    route53_latency_region = string
  }))

  validation {
    condition     = alltrue([for region in values(var.regions) : contains(["pilot", "ga"], region.status)])
    error_message = "A region's status is pilot or ga."
  }
}
