# Inputs of the topology module. It has no provider and creates nothing: it turns
# regions.yaml plus the deployment settings below into the plan of what runs where,
# so that `terraform test` can check that logic offline.

variable "config" {
  description = <<-EOT
    regions.yaml, decoded with yamldecode(). Read keys: apiVersion, redis.key_prefix,
    router.region, router.port, router.timeouts.total_s, heartbeat.interval_s,
    heartbeat.ttl_s, regions.<name>.models. Every other key is ignored, so new optional
    keys in regions.yaml do not need a change here (router_regions_yaml passes every key
    through to the routers, setting only batch.storage).
  EOT
  type        = any

  validation {
    condition     = try(var.config.apiVersion, null) == "globalpool/v1"
    error_message = "regions.yaml: apiVersion: this module reads globalpool/v1."
  }
  validation {
    condition     = length(try(keys(var.config.regions), [])) > 0
    error_message = "regions.yaml: regions: must name at least one region."
  }
}

variable "name_prefix" {
  description = "Prefix of every cloud resource name (lowercase letter first, at most 8 characters)."
  type        = string
  default     = "gp"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,7}$", var.name_prefix))
    error_message = "name_prefix: a lowercase letter, then at most 7 lowercase letters, digits or '-'."
  }
}

variable "network_cidr" {
  description = "The range that regional subnets are carved from (a /20 per cloud region)."
  type        = string
  default     = "10.64.0.0/10"

  validation {
    condition     = can(cidrsubnet(var.network_cidr, 10, 0))
    error_message = "network_cidr: an IPv4 range of /10 or larger (a /20 is carved per cloud region)."
  }
}

variable "defaults" {
  description = "Deployment settings used where neither region_settings nor model_settings say otherwise."
  type = object({
    gpu_machine_type    = optional(string, "g2-standard-8")
    gpu_type            = optional(string, "nvidia-l4")
    gpu_count           = optional(number, 1)
    gpu_replicas        = optional(number, 1)
    gpu_disk_gb         = optional(number, 200)
    gpu_disk_type       = optional(string, "pd-balanced")
    gpu_boot_s          = optional(number, 1800)
    spot                = optional(bool, false)
    max_num_seqs        = optional(number, 256)
    router_replicas     = optional(number, 2)
    router_max_replicas = optional(number) # null: three times router_replicas
    router_cpu_target   = optional(number, 0.6)
    router_machine_type = optional(string, "e2-standard-2")
    redis_machine_type  = optional(string, "e2-standard-2")
  })
  default  = {}
  nullable = false

  validation {
    condition     = var.defaults.gpu_boot_s >= 60 && var.defaults.gpu_boot_s <= 3600
    error_message = "defaults.gpu_boot_s: between 60 and 3600 (the autohealing delay GCE accepts)."
  }
  validation {
    condition     = var.defaults.router_cpu_target > 0 && var.defaults.router_cpu_target <= 1
    error_message = "defaults.router_cpu_target: the routers' mean CPU utilisation the autoscaler aims at, above 0 and at most 1 (0.6 = 60 %)."
  }
}

variable "region_settings" {
  description = <<-EOT
    Per region of regions.yaml (same names): where it runs in the cloud and how big it is.
    router_replicas is the fewest router replicas, router_max_replicas the most the
    autoscaler may add on CPU (default: three times router_replicas).
    cloud_region defaults from a small table of common names (us-east -> us-east4, ...), or
    the name itself when it is already a cloud region; subnet_cidr defaults to a /20 fixed
    per cloud region, so adding a region never moves another. gpu_pools is keyed by model.
  EOT
  type = map(object({
    cloud_region        = optional(string)
    zones               = optional(list(string))
    subnet_cidr         = optional(string)
    router_replicas     = optional(number)
    router_max_replicas = optional(number)
    router_machine_type = optional(string)
    redis_zone          = optional(string)
    redis_machine_type  = optional(string)
    gpu_pools = optional(map(object({
      replicas     = optional(number)
      machine_type = optional(string)
      gpu_type     = optional(string)
      gpu_count    = optional(number)
      spot         = optional(bool)
    })), {})
  }))
  default  = {}
  nullable = false

  validation {
    condition     = length(setsubtract(keys(var.region_settings), keys(try(var.config.regions, {})))) == 0
    error_message = "region_settings: every key must be a region of regions.yaml (a typo would otherwise be ignored)."
  }
}

variable "model_settings" {
  description = <<-EOT
    Per model name of regions.yaml: what vLLM serves under that name. source is the
    Hugging Face repository (or a local path on the image) given to `vllm serve`; the
    module adds --served-model-name, --host, --port, --max-num-seqs and, for more than one
    GPU, --tensor-parallel-size, so vllm_args must not repeat them.
  EOT
  type = map(object({
    source       = string
    vllm_args    = optional(list(string), [])
    max_num_seqs = optional(number)
    replicas     = optional(number)
    machine_type = optional(string)
    gpu_type     = optional(string)
    gpu_count    = optional(number)
    disk_gb      = optional(number)
  }))
  default  = {}
  nullable = false

  validation {
    condition = alltrue(flatten([
      for settings in values(var.model_settings) : [
        for arg in settings.vllm_args : !contains(
          ["--served-model-name", "--host", "--port", "--max-num-seqs"],
          split("=", arg)[0]
        )
      ]
    ]))
    error_message = "model_settings.*.vllm_args: --served-model-name, --host, --port and --max-num-seqs are set by the module."
  }
}

variable "redis_primary_region" {
  description = "The region whose Redis node is the primary when the deployment first starts (default: regions.yaml router.region, else the first region by name); the sentinels move the primary after that."
  type        = string
  default     = null

  validation {
    condition     = contains(concat(keys(try(var.config.regions, {})), ["\n"]), coalesce(var.redis_primary_region, "\n"))
    error_message = "redis_primary_region: must be a region of regions.yaml."
  }
}

variable "batch_storage" {
  description = "regions.yaml batch.storage for the deployed routers (gs://<bucket>/files: the store every replica shares); null: as regions.yaml says."
  type        = string
  default     = null

  validation {
    condition     = var.batch_storage == null || can(regex("^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/.*)?$", coalesce(var.batch_storage, "-")))
    error_message = "batch_storage: gs://bucket[/prefix] (replicas on many machines need a store they all reach)."
  }
}
