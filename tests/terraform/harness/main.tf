# Evaluates the topology module on a regions.yaml, the way the root module calls it, for
# tests/terraform/test_terraform_cli.py. No provider, no resources: `apply` only
# computes outputs.

variable "regions_yaml_path" {
  description = "The regions.yaml to evaluate."
  type        = string
}

variable "model_settings" {
  description = "As in the root module."
  type        = any
  default     = {}
}

variable "region_settings" {
  description = "As in the root module."
  type        = any
  default     = {}
}

variable "defaults" {
  description = "As in the root module."
  type        = any
  default     = {}
}

variable "batch_storage" {
  description = "As the root module passes it (module.files.storage)."
  type        = string
  default     = null
}

module "topology" {
  source = "../../../terraform/modules/topology"

  config          = yamldecode(file(var.regions_yaml_path))
  model_settings  = var.model_settings
  region_settings = var.region_settings
  defaults        = var.defaults
  batch_storage   = var.batch_storage
}

output "regions" {
  value = module.topology.regions
}

output "gpu_pools" {
  value = module.topology.gpu_pools
}

output "redis_primary_region" {
  value = module.topology.redis_primary_region
}

output "router" {
  value = module.topology.router
}

output "redis" {
  value = module.topology.redis
}

output "router_regions_yaml" {
  value = module.topology.router_regions_yaml
}

output "files_location" {
  value = module.topology.files_location
}
