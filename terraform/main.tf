# globalpool on Google Cloud, driven by ../regions.yaml: every region there gets a subnet,
# router replicas, a Redis node (redis-server and a sentinel: together a Redis Sentinel
# group with automatic failover) and one GPU pool per model it serves; one anycast load
# balancer is the global entry point; one bucket holds the Files and Batch APIs' files.

locals {
  regions_yaml_path = coalesce(var.regions_yaml_path, "${path.module}/../regions.yaml")
  regions_yaml      = file(local.regions_yaml_path)
  # Routers and agents install globalpool's dependencies at these versions (../.ci/lock).
  requirements_lock = file("${path.module}/../requirements.lock")
  services = [
    "compute.googleapis.com",
    "dns.googleapis.com",
    "secretmanager.googleapis.com",
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "iap.googleapis.com",
    "storage.googleapis.com",
  ]
  # Each Redis node's name in the private zone. The nodes find each other by these names
  # at boot (a node cannot be given the others' addresses: they are outputs of the same
  # module), and their certificates carry them.
  redis_hosts = {
    for name in keys(module.topology.regions) : name => "redis-${name}.${trimsuffix(module.network.dns_zone.domain, ".")}"
  }
  # What routers and agents connect to: every node's sentinel (TLS), by address. They ask
  # the sentinels for the primary on every new connection (rediss+sentinel:// URLs).
  redis_sentinels = join(",", [for name in sort(keys(module.redis)) : "${module.redis[name].address}:26379"])
}

# Which regions, which pools, how many of each, which Redis is the initial primary and
# the sentinels' quorum: all derived here, with no provider, and tested offline
# (modules/topology/tests).
module "topology" {
  source = "./modules/topology"

  config               = yamldecode(local.regions_yaml)
  name_prefix          = var.name_prefix
  model_settings       = var.model_settings
  region_settings      = var.region_settings
  defaults             = var.defaults
  redis_primary_region = var.redis_primary_region
  # The routers' regions.yaml names the deployment's bucket (router_regions_yaml).
  batch_storage = module.files.storage
}

resource "google_project_service" "api" {
  for_each           = toset(local.services)
  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}

module "iam" {
  source     = "./modules/iam"
  depends_on = [google_project_service.api]

  project_id  = var.project_id
  name_prefix = var.name_prefix
}

module "secrets" {
  source     = "./modules/secrets"
  depends_on = [google_project_service.api]

  project_id  = var.project_id
  name_prefix = var.name_prefix
  readers     = module.iam.emails
  labels      = var.labels
}

# The Files and Batch APIs' store: one bucket that every region's routers share (a batch
# uploaded through one region is run by replicas everywhere); only the routers may use it.
module "files" {
  source     = "./modules/files"
  depends_on = [google_project_service.api]

  project_id             = var.project_id
  name_prefix            = var.name_prefix
  location               = coalesce(var.files_location, module.topology.files_location)
  retention_days         = var.files_retention_days
  kms_key_name           = var.files_kms_key_name
  router_service_account = module.iam.emails.router
  labels                 = var.labels
}

module "network" {
  source     = "./modules/network"
  depends_on = [google_project_service.api]

  project_id       = var.project_id
  name_prefix      = var.name_prefix
  regions          = module.topology.regions
  service_accounts = module.iam.emails
  router_port      = module.topology.router.port
  engine_port      = module.topology.worker.engine_port
  enable_iap_ssh   = var.enable_iap_ssh
}

module "redis" {
  source   = "./modules/redis"
  for_each = module.topology.regions

  project_id      = var.project_id
  region          = each.key
  cloud_region    = each.value.cloud_region
  node            = each.value.redis
  host            = local.redis_hosts[each.key]
  subnetwork      = module.network.subnetworks[each.key]
  service_account = module.iam.emails.redis
  image           = var.base_image
  labels          = var.labels
  settings = {
    redis_service            = module.topology.redis.service
    initial_primary_host     = local.redis_hosts[module.topology.redis_primary_region]
    redis_nodes              = join(" ", values(local.redis_hosts))
    sentinel_quorum          = module.topology.redis.quorum
    down_after_ms            = module.topology.redis.down_after_ms
    failover_timeout_ms      = module.topology.redis.failover_timeout_ms
    redis_password_secret    = module.secrets.ids["redis-password"]
    redis_tls_ca_cert_secret = module.secrets.ids["redis-tls-ca-cert"]
    redis_tls_ca_key_secret  = module.secrets.ids["redis-tls-ca-key"]
    ops_agent                = var.ops_agent
  }
}

# redis-<region>.<zone>: each region's node. Nodes find each other by these names at boot;
# clients use addresses (redis_sentinels) and never need a name to move on failover.
resource "google_dns_record_set" "redis_region" {
  for_each     = module.topology.regions
  project      = var.project_id
  managed_zone = module.network.dns_zone.name
  name         = "${local.redis_hosts[each.key]}."
  type         = "A"
  ttl          = 300
  rrdatas      = [module.redis[each.key].address]
}

module "gpu_pool" {
  source   = "./modules/gpu_pool"
  for_each = module.topology.gpu_pools

  project_id      = var.project_id
  pool            = each.value
  subnetwork      = module.network.subnetworks[each.value.region]
  service_account = module.iam.emails.worker
  image           = var.gpu_image
  labels          = var.labels
  settings = merge(module.topology.worker, {
    globalpool_pip_spec      = var.globalpool_pip_spec
    requirements_lock        = local.requirements_lock
    vllm_pip_spec            = var.vllm_pip_spec
    redis_sentinels          = local.redis_sentinels
    redis_service            = module.topology.redis.service
    redis_password_secret    = module.secrets.ids["redis-password"]
    redis_tls_ca_cert_secret = module.secrets.ids["redis-tls-ca-cert"]
    heartbeat_keys_secret    = module.secrets.ids["heartbeat-keys"]
    hf_token_secret          = module.secrets.ids["hf-token"]
    upstream_api_key_secret  = module.secrets.ids["upstream-api-key"]
    ops_agent                = var.ops_agent
  })
}

module "router" {
  source   = "./modules/router"
  for_each = module.topology.regions

  project_id      = var.project_id
  region          = each.key
  cloud_region    = each.value.cloud_region
  zones           = each.value.zones
  name            = each.value.router.name
  replicas        = each.value.router.replicas
  max_replicas    = each.value.router.max_replicas
  cpu_target      = each.value.router.cpu_target
  machine_type    = each.value.router.machine_type
  port            = module.topology.router.port
  health_path     = module.topology.router.health_path
  subnetwork      = module.network.subnetworks[each.key]
  service_account = module.iam.emails.router
  image           = var.base_image
  regions_yaml    = module.topology.router_regions_yaml
  labels          = var.labels
  settings = {
    globalpool_pip_spec      = var.globalpool_pip_spec
    requirements_lock        = local.requirements_lock
    redis_sentinels          = local.redis_sentinels
    redis_service            = module.topology.redis.service
    redis_password_secret    = module.secrets.ids["redis-password"]
    redis_tls_ca_cert_secret = module.secrets.ids["redis-tls-ca-cert"]
    heartbeat_keys_secret    = module.secrets.ids["heartbeat-keys"]
    admin_token_secret       = module.secrets.ids["admin-token"]
    admin_token_env          = module.topology.router.admin_token_env
    api_keys_secret          = module.secrets.ids["api-keys"]
    keys_file                = module.topology.router.keys_file
    upstream_api_key_secret  = module.secrets.ids["upstream-api-key"]
    upstream_key_envs        = module.topology.router.upstream_key_envs
    ops_agent                = var.ops_agent
  }
}

module "global_lb" {
  source = "./modules/global_lb"

  project_id    = var.project_id
  name_prefix   = var.name_prefix
  domain        = var.domain
  router_groups = { for name, router in module.router : name => router.instance_group }
  port          = module.topology.router.port
  health_path   = module.topology.router.ready_path
  timeout_s     = module.topology.router.lb_timeout_s
  dns_zone_name = var.dns_zone_name
}
