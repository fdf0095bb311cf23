output "router_endpoint" {
  description = "The global API endpoint (OpenAI clients: base_url = \"<router_endpoint>/v1\")."
  value       = module.global_lb.url
}

output "router_ip_address" {
  description = "The anycast IP of the API: point the domain's A record here (unless dns_zone_name is set)."
  value       = module.global_lb.ip_address
}

output "router_instance_groups" {
  description = "Per region: the router replicas' instance group (the load balancer's backends)."
  value       = { for name, router in module.router : name => router.instance_group }
}

output "gpu_pools" {
  description = "Per \"<region>/<model>\": the GPU pool's instance group manager and size."
  value = {
    for key, pool in module.topology.gpu_pools : key => {
      instance_group_manager = module.gpu_pool[key].name
      cloud_region           = pool.cloud_region
      replicas               = pool.replicas
      machine_type           = pool.machine_type
      gpus                   = "${pool.gpu_count} x ${pool.gpu_type}"
    }
  }
}

output "redis" {
  description = "The Redis Sentinel group: each region's node (redis-server on 6379 and a sentinel on 26379, TLS only), the sentinels clients ask, the quorum, and the region of the initial primary (the sentinels move the primary after that; ask one which node it is now with primary_query)."
  value = {
    initial_primary_region = module.topology.redis_primary_region
    sentinels              = local.redis_sentinels
    quorum                 = module.topology.redis.quorum
    nodes = {
      for name, node in module.redis : name => { address = node.address, host = local.redis_hosts[name], initial_role = node.initial_role }
    }
    primary_query = "redis-cli --tls --cacert /etc/redis/tls/ca.pem -h 127.0.0.1 -p 26379 --askpass SENTINEL get-master-addr-by-name ${module.topology.redis.service}  # on any Redis node (gcloud compute ssh NODE --tunnel-through-iap); the password is the secret redis-password"
  }
}

output "secrets_to_fill" {
  description = "Secret Manager secrets created empty: give each its value with these commands."
  value       = module.secrets.add_version_commands
}

output "files_bucket" {
  description = "The bucket of the Files and Batch APIs (regions.yaml batch.storage on every router: storage); objects are deleted after files_retention_days."
  value = {
    name    = module.files.name
    storage = module.files.storage
  }
}
