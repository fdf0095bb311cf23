output "regions" {
  description = "Per region of regions.yaml: cloud region, zones, subnet, router group (replicas: the autoscaler's minimum) and Redis node (role: at the first start)."
  value       = local.regions

  precondition {
    condition     = length(local.unmapped_regions) == 0
    error_message = "No cloud region for ${join(", ", local.unmapped_regions)}: set region_settings[\"<name>\"].cloud_region (e.g. \"us-east4\")."
  }
  precondition {
    condition     = length(local.uncarved_regions) == 0
    error_message = "No subnet range for ${join(", ", local.uncarved_regions)}: their cloud region is not in the module's slot table; set region_settings[\"<name>\"].subnet_cidr."
  }
  precondition {
    condition     = !local.duplicate_subnets
    error_message = "Two regions have the same subnet range (two names on one cloud region?): give each a distinct region_settings[\"<name>\"].subnet_cidr."
  }
  precondition {
    condition     = !local.duplicate_names
    error_message = "Two resources would get the same name (models whose names differ only in case or punctuation?): rename one model."
  }
  precondition {
    condition     = length(local.invalid_router_counts) == 0
    error_message = "router_replicas must be a whole number >= 1, and router_max_replicas a whole number >= router_replicas, in ${join(", ", local.invalid_router_counts)}."
  }
}

output "gpu_pools" {
  description = "Per \"<region>/<model>\": one GPU instance group running vLLM and the worker agent."
  value       = local.gpu_pools

  precondition {
    condition     = length(local.unsourced_models) == 0
    error_message = "regions.yaml serves ${join(", ", local.unsourced_models)} but model_settings does not say what vLLM loads for it: add model_settings[\"<model>\"] = { source = \"<hf repo>\" }."
  }
  precondition {
    condition     = length(local.invalid_pool_counts) == 0
    error_message = "Whole numbers needed (replicas >= 0, gpu_count >= 1, max_num_seqs >= 1): ${join(", ", local.invalid_pool_counts)}."
  }
}

output "redis_primary_region" {
  description = "The region whose Redis node is the primary when the deployment first starts (every other region's is a replica of it); the sentinels move the primary after that."
  value       = local.redis_primary_region
}

output "redis" {
  description = "The Redis Sentinel group: the monitored service's name, the initial primary's region, the number of nodes (one per region), the quorum (a majority of them) and the failover timings (see locals)."
  value       = local.redis
}

output "router" {
  description = "What router replicas need from regions.yaml: port, load balancer timeout, and where their secrets go."
  value = {
    port        = local.router_port
    health_path = "/health" # liveness: autohealing replaces a replica that fails it
    ready_path  = "/ready"  # readiness: the load balancer sends clients only to replicas that can route
    # A streamed answer may take router.timeouts.total_s; the load balancer must not cut it first.
    lb_timeout_s = ceil(local.router_total_s) + 30
    # admin.token_env: the variable that holds the admin token.
    admin_token_env = local.admin_token_env
    # auth.keys_file: where the API key hashes (secret api-keys) are written; null: none.
    keys_file = local.keys_file
    # regions.*.upstream_api_key_env: variables that carry the key vLLM requires.
    upstream_key_envs = local.upstream_key_envs
  }
}

output "worker" {
  description = "What every worker agent needs from regions.yaml (passed as flags, so that unrelated regions.yaml edits do not roll GPU machines)."
  value = {
    key_prefix           = local.key_prefix
    heartbeat_interval_s = local.heartbeat_interval_s
    heartbeat_ttl_s      = local.heartbeat_ttl_s
    engine_port          = local.engine_port
  }
}

output "models" {
  description = "Every model name served in some region."
  value       = local.all_model_names
}

output "router_regions_yaml" {
  description = "The text of the regions.yaml router replicas run with: regions.yaml with batch.storage = batch_storage (when set), every other key as the operator wrote it."
  value       = local.router_regions_yaml
}

output "files_location" {
  description = "The default location of the files bucket: US, EU or ASIA for a home region (the initial Redis primary's) on that continent, else that cloud region."
  value       = local.files_location
}
