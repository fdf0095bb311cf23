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
  description = "The Redis primary's DNS name and region, and each region's node."
  value = {
    primary_host   = local.redis_primary_host
    primary_region = module.topology.redis_primary_region
    nodes          = { for name, node in module.redis : name => { address = node.address, role = node.role } }
  }
}

output "secrets_to_fill" {
  description = "Secret Manager secrets created empty: give each its value with these commands."
  value       = module.secrets.add_version_commands
}
